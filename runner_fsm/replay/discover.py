"""The ranks of a run, found on disk: each rank's log (`rank-<global_rank>.jsonl`, and the
segments of a capped log, `rank-<global_rank>.<k>.jsonl`: `audit.ranklog`) with its coordinates
and groups, taken from the `job` record it begins with (`audit.shape`), else from its records'
header (`dp_rank`, `pcp_rank`; TP and PP then 0); a file with no readable record (killed
before its first line was complete) gets them from its global rank and the shape a sibling
declares, or, in logs written without one, from its global rank and the PCP size its siblings
show.

`Run` is a run found once: its directories and its ranks. Every reader of the run (replay's
judgement, the Flight Recorder join, the timeline picture, the Perfetto export) takes the same
`Run`, so a replay lists and probes each rank's files once.
"""

from __future__ import annotations

import re
import dataclasses
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import orjson

from runner_fsm.audit.compress import open_lines
from runner_fsm.audit.ranklog import RANK_SEGMENT_PATTERN, read_segments, rotated_ranges
from runner_fsm.audit.shape import DIMENSIONS, JOB_EVENT, Coords, JobShape
from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.rundirs import RunDirs, as_dirs, label, ranked_segments
from runner_fsm.rules.ranks import RankInfo

RANK_FILE = re.compile(RANK_SEGMENT_PATTERN)
_PROBE_LINES = 64  # enough to get past a damaged first line, few enough to stay instant


@dataclasses.dataclass(frozen=True)
class Run:
    """One run, found once: the directories it was read from and each rank's `RankInfo`."""

    dirs: tuple[Path, ...]
    ranks: tuple[RankInfo, ...]

    @classmethod
    def find(cls, run_dir: RunDirs) -> Run:
        """The run in `run_dir` (one directory, or several: the nodes of one job);
        `ReplayInputError` as `discover` raises it."""
        return cls(as_dirs(run_dir), tuple(discover(run_dir)))

    @property
    def label(self) -> str:
        """How a report names the run: its directory, or 'A + B' for several."""
        return label(self.dirs)


def discover(run_dir: RunDirs) -> list[RankInfo]:
    """Every rank file of `run_dir` (one directory, or several: `replay.rundirs`) with its
    coordinates; `ReplayInputError` if none can be read, or one rank's log is found twice."""
    dirs = as_dirs(run_dir)
    segments = {rank: read_segments(numbered) for rank, numbered in ranked_segments(dirs, RANK_FILE, "audit log").items()}
    if not segments:
        where = " or ".join(map(str, dirs))
        raise ReplayInputError(f"no rank-<global_rank>.jsonl files in {where}; is it a run directory?")
    ranked = [(rank, kept[0].path) for rank, kept in segments.items()]
    probed = {rank: _probe(path) for rank, path in ranked}
    shape = next((found.shape for found in probed.values() if found.shape is not None), None)
    pcp_size = 1 + max((found.coords.pcp for found in probed.values() if found.coords), default=0)
    infos = []
    for rank, path in ranked:
        found = probed[rank]
        coords = found.coords
        if found.job is None and shape is not None:  # no `job` record of its own: the shape's place
            coords = shape.coords(rank) if rank < shape.world_size else coords
        if coords is None:
            coords = Coords(*divmod(rank, pcp_size))
        hosts = found.job.get("hosts") if found.job is not None else None
        k = found.job.get("num_speculative_tokens") if found.job is not None else None
        infos.append(RankInfo(rank, coords.dp, coords.pcp, path, found.shape, coords.tp, coords.pp,
                              found.groups, found.host, hosts if isinstance(hosts, dict) else None,
                              k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else None,
                              segments[rank], rotated_ranges(segments[rank]), _run_id(found.job)))
    return infos


def _run_id(job: dict | None) -> str | None:
    run_id = job.get("run_id") if job is not None else None
    return run_id if isinstance(run_id, str) else None


class _Probed(NamedTuple):
    coords: Coords | None  # from the `job` record, else the first header with both coordinates
    shape: JobShape | None  # the job, when the first line is a `job` record
    job: dict | None  # that record
    groups: tuple = ()
    host: str | None = None


def _probe(path: Path) -> _Probed:
    """What the head of one log says of its rank: its coordinates (None: no record has them)
    and, when the first line is a `job` record, the job's shape, the rank's groups and host
    (a log of a writer that logs no shape: None)."""
    try:
        with open_lines(path) as lines:
            for line_no, raw in enumerate(islice(lines, _PROBE_LINES), 1):
                try:
                    record = orjson.loads(raw)
                    dp_rank, pcp_rank = record["dp_rank"], record["pcp_rank"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
                if line_no == 1 and record.get("event") == JOB_EVENT:
                    return _from_job(path, record)
                if isinstance(dp_rank, int) and isinstance(pcp_rank, int):
                    return _Probed(Coords(dp_rank, 0, pcp_rank, 0), None, None)
    except OSError as err:
        raise ReplayInputError(f"cannot read {path}: {err}") from err
    return _Probed(None, None, None)


def _from_job(path: Path, record: dict) -> _Probed:
    try:
        shape = JobShape.from_record(record)
        coords = _job_coords(record, shape)
        groups = tuple(sorted((str(name), tuple(int(r) for r in members))
                              for name, members in (record.get("groups") or {}).items()))
    except (ValueError, TypeError, AttributeError) as err:
        raise ReplayInputError(f"{path}:1: unreadable job shape: {err}") from None
    host = record.get("host")
    return _Probed(coords, shape, record, groups, host if isinstance(host, str) else None)


def _job_coords(record: dict, shape: JobShape) -> Coords:
    """The rank's coordinates as its `job` record gives them (schema 2), else from the header
    (schema 1: DP x PCP only); each within the shape's sizes."""
    given = record.get("coords")
    if isinstance(given, dict):
        coords = Coords(*(given.get(name, 0) for name in DIMENSIONS))
    else:
        coords = Coords(record["dp_rank"], 0, record["pcp_rank"], 0)
    for name, value, size in zip(DIMENSIONS, coords, shape.sizes):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
            raise ValueError(f"its {name} coordinate {value!r} is outside [0, {size})")
    return coords
