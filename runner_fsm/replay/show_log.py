"""`runner-fsm log RUN_DIR`: a run's audit records in full, one JSON object per line.

The records are those `read_records` yields (DESIGN section 7: every header field, the compact
on-disk keys expanded), read from each kept segment of each rank's log in order (`rank-<g>.jsonl`,
the rotated `rank-<g>.<k>.jsonl`, compressed `.jsonl.gz`: `ranklog`), rank by rank in
global-rank order. Nothing is parsed here: the ranks are `ranks.discover`'s, the records
`read_records`'.

A step window keeps the records whose `step_id` lies in it, plus the `job` record heading each
segment it keeps records from (first of all, the rank's output says whose records follow);
records without a step (a segment's `job` record, a stop requested before any step) are outside
every window. `--steps A:B` includes both ends, as replay's does (`coverage.parse_steps`);
`--last N` is per rank: the steps L-N+1..L, L the last step of that rank's log (a rank that
stopped early shows its own last steps, where a hang or a death is). Segments wholly outside
the window are not read: their first step is in their `job` record, their last in their step
index (`ranklog`). Within a segment the reading starts at its first record and stops past the
window: a seek would resume the compact expansion mid-segment, where a record's state and time
base are not known (`expand.Expander.resume`), and the output must be what the full reader gives.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TextIO

from runner_fsm.audit.ranklog import SegmentFile, last_step
from runner_fsm.audit.records import read_records
from runner_fsm.audit.shape import JOB_EVENT
from runner_fsm.errors import ReplayInputError, RunnerError
from runner_fsm.replay.discover import discover
from runner_fsm.replay.rankscan import log_last_step
from runner_fsm.replay.rundirs import RunDirs, as_dirs, label
from runner_fsm.rules.ranks import RankInfo

Window = tuple[int, int]  # steps A..B, both included


class LogInputError(RunnerError):
    """The logs cannot be shown: no run directory, no rank logs, an unknown rank, a bad window."""


def iter_log_records(run_dir: RunDirs, *, ranks: Sequence[int] | None = None, steps: Window | None = None,
                     last: int | None = None) -> Iterator[dict[str, Any]]:
    """Every record of the chosen `ranks` (None: all) in full, rank by rank, within the window
    (`steps` A..B or the `last` N steps of each rank; neither: every record). The input is
    checked here, before the first record: `LogInputError` for a run that cannot be shown."""
    if steps is not None and last is not None:
        raise LogInputError("give --steps or --last, not both")
    if steps is not None and steps[0] > steps[1]:
        raise LogInputError(f"--steps A:B needs A <= B, got {steps[0]}:{steps[1]}")
    if last is not None and last < 1:
        raise LogInputError(f"--last needs a positive number of steps, got {last}")
    infos = _chosen_ranks(run_dir, ranks)
    return _records(infos, steps, last)


def print_log(run_dir: RunDirs, *, out: TextIO | None = None, **chosen) -> int:
    """Write `iter_log_records(run_dir, **chosen)` to `out` (stdout), one JSON object per line;
    the exit status (0). A reader that closes the pipe early (`| head`) ends the output quietly."""
    records = iter_log_records(run_dir, **chosen)
    out = sys.stdout if out is None else out
    written = 0
    try:
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
            written += 1
        out.flush()
    except BrokenPipeError:
        _silence(out)
        return 0
    if not written and (chosen.get("steps") is not None or chosen.get("last") is not None):
        print(f"runner-fsm log: no record of {label(run_dir)} lies in the window", file=sys.stderr)
    return 0


def _chosen_ranks(run_dir: RunDirs, ranks: Sequence[int] | None) -> list[RankInfo]:
    try:
        infos = discover(run_dir)
    except ReplayInputError as err:
        raise LogInputError(_with_runs_below(run_dir, str(err))) from None
    if ranks is None:
        return infos
    found = {info.global_rank: info for info in infos}
    unknown = [rank for rank in ranks if rank not in found]
    if unknown:
        raise LogInputError(f"no audit log of rank {unknown[0]} in {label(run_dir)}"
                            f" (its logs are of ranks {_ranges(found)})")
    return [found[rank] for rank in sorted(set(ranks))]


def _with_runs_below(run_dir: RunDirs, message: str) -> str:
    """`message`, or, for a folder of runs (`runs`), which runs it holds: one is to be named."""
    from runner_fsm.replay.runs import run_dirs_below

    dirs = as_dirs(run_dir)
    below = run_dirs_below(dirs[0]) if len(dirs) == 1 and dirs[0].is_dir() else []
    if not below:
        return message
    return f"{dirs[0]} holds {len(below)} run directories, not one run ({', '.join(map(str, below))}): give one"


def _ranges(ranks: Iterable[int]) -> str:
    """'0-3, 6' for the ranks 0, 1, 2, 3, 6."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and spans[-1][1] + 1 == rank:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _records(infos: list[RankInfo], steps: Window | None, last: int | None) -> Iterator[dict[str, Any]]:
    for info in infos:
        window = steps if last is None else _last_steps(info, last)
        for segment in info.segments:
            if window is not None and _outside(segment, window):
                if segment.first_step is not None and segment.first_step > window[1]:
                    break  # the segments after it begin later still
                continue
            yield from _segment_records(segment, window)


def _last_steps(info: RankInfo, n: int) -> Window | None:
    """The rank's last `n` steps; None (every record) for a log that holds no step at all."""
    end = log_last_step(info)
    return None if end is None else (end - n + 1, end)


def _outside(segment: SegmentFile, window: Window) -> bool:
    """Whether the segment holds no step of `window` (by its first and last step; unknown: read it)."""
    if segment.first_step is not None and segment.first_step > window[1]:
        return True
    end = last_step(segment)
    return end is not None and end < window[0]


def _segment_records(segment: SegmentFile, window: Window | None) -> Iterator[dict[str, Any]]:
    """The segment's records in full; within `window`, those of its steps, after its `job` record."""
    job = None
    try:
        for record in read_records(segment.path):
            if window is None:
                yield record
                continue
            step = record.get("step_id")
            if record.get("event") == JOB_EVENT and job is None:
                job = record  # printed only if the segment has records in the window
            elif isinstance(step, int) and not isinstance(step, bool):
                if step > window[1]:
                    return  # a log is ordered by step: nothing later is in the window
                if step >= window[0]:
                    if job is not None:
                        yield job
                        job = None
                    yield record
    except FileNotFoundError:
        return  # rotated away by a live writer since it was found: its records are gone
    except EOFError as err:  # a compressed segment cut short
        raise LogInputError(f"{segment.path}: {err}") from None


def _silence(out: TextIO) -> None:
    """After a closed pipe: what is still buffered for stdout goes nowhere, so the interpreter's
    last flush raises nothing either (no traceback for `runner-fsm log ... | head`)."""
    if out is not sys.stdout:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture)
        pass
