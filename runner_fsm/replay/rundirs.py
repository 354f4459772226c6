"""The directories of one run: where its rank logs and Flight Recorder dumps are.

A run is usually one directory, but a job on several machines leaves one per node (each
node's ranks write where that node can), and `runner-fsm replay A B ...` judges them together
as one run. Each rank's file must be found once: the same rank's log (or dump) in two of the
directories given is input that cannot be judged (exit status 2), as are logs of different runs
(`rules.job`). Nothing here compares the clocks of different hosts.

Beside the logs, vLLM's front process records each stop request it received where it started
(`stops-<host>-<pid>.jsonl`, `integrations.vllm.stop_origin`): one line per request, with the
ranks whose worker process was alive then. Only lines of the run being judged count (a run
directory used again keeps an older run's file); a line that cannot be read is said in a note.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Union

import orjson

from runner_fsm.errors import ReplayInputError
from runner_fsm.rules.facts import OriginStop

ORIGIN_FILE = re.compile(r"^stops-.+-\d+\.jsonl$")
RunDirs = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


def as_dirs(run_dir: RunDirs) -> tuple[Path, ...]:
    """The directories `run_dir` names (one path, or several), each once, in the order given."""
    paths = [run_dir] if isinstance(run_dir, (str, os.PathLike)) else list(run_dir)
    if not paths:
        raise ReplayInputError("no run directory given")
    return tuple(dict.fromkeys(Path(p) for p in paths))


def label(run_dir: RunDirs) -> str:
    """How a report names the run: its directory, or 'A + B' for several."""
    return " + ".join(str(d) for d in as_dirs(run_dir))


def listing(directory: Path) -> list[str]:
    """The names in one run directory; ReplayInputError when it is not one."""
    if not directory.exists():
        raise ReplayInputError(f"run directory {directory} does not exist")
    if not directory.is_dir():
        raise ReplayInputError(f"{directory} is not a directory (expected a run directory of rank-*.jsonl)")
    try:
        return sorted(os.listdir(directory))
    except OSError as err:
        raise ReplayInputError(f"cannot list run directory {directory}: {err}") from err


def ranked_segments(dirs: Sequence[Path], pattern: re.Pattern, what: str) -> dict[int, list[tuple[int, Path]]]:
    """{global rank: [(segment, path), ...] by segment} of every file of `dirs` whose name
    `pattern` matches (group 1: the rank, group 2: the segment, none for segment 0);
    ReplayInputError when one rank's files are in two of them, or one segment is found twice
    (but for a segment being compressed, `<name>` and `<name>.gz` side by side: the first)."""
    found: dict[int, dict[int, Path]] = {}
    for directory in dirs:
        for name in listing(directory):
            match = pattern.match(name)
            if match is None:
                continue
            rank, index, path = int(match[1]), int(match[2] or 0), directory / name
            segments = found.setdefault(rank, {})
            twin = segments.get(index)
            if twin is not None and twin.parent == directory and _compressed_twins(twin.name, name):
                segments[index] = path if twin.name.endswith(".gz") else twin  # the plain one, whole
                continue
            elsewhere = next((p for p in segments.values() if p.parent != directory), None)
            if index in segments or elsewhere is not None:
                first = segments.get(index, elsewhere)
                raise ReplayInputError(f"rank {rank}'s {what} is in {first.parent} and in {directory}"
                                       f" ({name}): one rank's {what} found twice")
            segments[index] = path
    return {rank: sorted(segments.items()) for rank, segments in sorted(found.items())}


def _compressed_twins(a: str, b: str) -> bool:
    """A segment and its compressed form (`audit.compress`), side by side while it is made."""
    return a + ".gz" == b or b + ".gz" == a


def ranked_files(dirs: Sequence[Path], pattern: re.Pattern, what: str) -> list[tuple[int, Path]]:
    """(global rank, path) of every file of `dirs` whose name `pattern` matches (group 1: the
    rank), by rank; ReplayInputError when one rank's file is in two of them."""
    found: dict[int, Path] = {}
    for directory in dirs:
        for name in listing(directory):
            match = pattern.match(name)
            if match is None:
                continue
            rank, path = int(match[1]), directory / name
            if rank in found:
                raise ReplayInputError(f"rank {rank}'s {what} is in {found[rank].parent} and in {directory}"
                                       f" ({name}): one rank's {what} found twice")
            found[rank] = path
    return sorted(found.items())


def read_origins(dirs: Sequence[Path], run_ids: Iterable[str | None]) -> tuple[list[OriginStop], list[str]]:
    """The requests of the run whose ranks name `run_ids`, and a note per line that could not be read."""
    wanted = {run_id for run_id in run_ids if run_id is not None}
    found: list[OriginStop] = []
    notes: list[str] = []
    for directory in dirs:
        for name in listing(directory):
            if not ORIGIN_FILE.match(name):
                continue
            try:
                lines = (directory / name).read_bytes().splitlines()
            except OSError as err:
                notes.append(f"{directory / name}: cannot be read ({err}): its stop requests are not counted")
                continue
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    origin, run_id = OriginStop.from_record(orjson.loads(line))
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                    notes.append(f"{directory / name}:{number}: not a stop request ({err}): not counted")
                    continue
                if run_id in wanted:
                    found.append(origin)
    return found, notes
