"""The ranks of a run: their log files, coordinates, groups and hosts.

- `discover`: each `rank-<global_rank>.jsonl` with its coordinates and groups, taken from the
  `job` record it begins with (`audit.shape`), else from its records' header (`dp_rank`,
  `pcp_rank`; TP and PP then 0); a file with no readable record (killed before its first line
  was complete) gets them from its global rank and the shape a sibling declares, or, in logs
  written without one, from its global rank and the PCP size its siblings show.
- `Groups`: which ranks must issue the same collectives. A rank's instance of a group is the
  member list a `job` record gives for it (its own, or a peer's that lists it), else the
  layout's: `dp`, `pp`, `pcp` and `tp` are the ranks that differ from it in that dimension
  alone (the DP agreement's group is one per (pp, pcp, tp)), anything else (`expert`, ...)
  one group over every rank.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import NamedTuple
import dataclasses
import re

import orjson

from runner_fsm.audit.report import ReplayInputError
from runner_fsm.audit.rundirs import RunDirs, as_dirs, ranked_files
from runner_fsm.audit.shape import DIMENSIONS, JOB_EVENT, Coords, JobShape

RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
_PROBE_LINES = 64  # enough to get past a damaged first line, few enough to stay instant


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One process of the run: its global rank, its coordinates and its log file."""

    global_rank: int
    dp_rank: int
    pcp_rank: int
    path: Path
    shape: JobShape | None = None  # the job as this log's first record declares it
    tp_rank: int = 0
    pp_rank: int = 0
    # ((group, members), ...) as this log's `job` record lists them (empty: no record)
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()
    host: str | None = None  # where the process ran, as its `job` record says
    hosts: dict | None = dataclasses.field(default=None, compare=False)  # the job's {host: [ranks]}, if gathered

    @property
    def file(self) -> str:
        return self.path.name

    @property
    def coords(self) -> Coords:
        return Coords(self.dp_rank, self.pp_rank, self.pcp_rank, self.tp_rank)

    def rank_text(self) -> str:
        """'rank 5 (dp 1, pcp 0, tp 1)' with the job's dimensions in use (every one, unknown)."""
        sizes = self.shape.sizes if self.shape is not None else None
        return f"rank {self.global_rank} ({self.coords.text(sizes)})"


def discover(run_dir: RunDirs) -> list[RankInfo]:
    """Every rank file of `run_dir` (one directory, or several: `audit.rundirs`) with its
    coordinates; `ReplayInputError` if none can be read, or one rank's log is found twice."""
    dirs = as_dirs(run_dir)
    ranked = ranked_files(dirs, RANK_FILE, "audit log")
    if not ranked:
        where = " or ".join(map(str, dirs))
        raise ReplayInputError(f"no rank-<global_rank>.jsonl files in {where}; is it a run directory?")
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
        infos.append(RankInfo(rank, coords.dp, coords.pcp, path, found.shape, coords.tp, coords.pp,
                              found.groups, found.host, hosts if isinstance(hosts, dict) else None))
    return infos


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
        with open(path, "rb") as lines:
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


def layout_of(infos: list[RankInfo]) -> Coords:
    """The (dp, pp, pcp, tp) sizes: as the job's shape declares them, else as the rank files show them."""
    shape = next((i.shape for i in infos if i.shape is not None), None)
    if shape is not None:
        return shape.sizes
    return Coords(*(1 + max(getattr(i, f"{name}_rank") for i in infos) for name in DIMENSIONS))


class Groups:
    """Group instances of a run, memoised: `instance(group, rank)`, `members(key)`.

    An instance is keyed by its group's name and its members: those a `job` record lists (a
    rank whose own record is lost is placed by a peer's list that names it), else the ranks
    that share every coordinate but the group's own dimension (`dp`, `pp`, `pcp`, `tp`), else,
    for any other group, every rank of the run."""

    def __init__(self, infos: list[RankInfo]):
        self.infos = {info.global_rank: info for info in infos}
        self._instance: dict[tuple[str, int], tuple] = {}
        self._members: dict[tuple, tuple[int, ...]] = {}
        self._listed: dict[tuple[str, int], tuple] = {}  # (group, rank) -> key, from job records
        for info in infos:
            for name, members in info.groups:
                for member in members:
                    self._listed.setdefault((name, member), (name, members))

    def instance(self, group: str, rank: int) -> tuple:
        key = self._instance.get((group, rank))
        if key is None:
            key = self._instance[(group, rank)] = self._listed.get((group, rank)) or self._by_layout(group, rank)
        return key

    def _by_layout(self, group: str, rank: int) -> tuple:
        if group not in DIMENSIONS:
            return (group, tuple(sorted(self.infos)))
        axis = DIMENSIONS.index(group)
        mine = self.infos[rank].coords
        same = tuple(r for r, info in sorted(self.infos.items())
                     if all(a == b for i, (a, b) in enumerate(zip(info.coords, mine)) if i != axis))
        return (group, same)

    def members(self, group: str, key: tuple) -> tuple[int, ...]:
        found = self._members.get(key)
        if found is None:
            found = self._members[key] = tuple(r for r in sorted(self.infos) if self.instance(group, r) == key)
        return found

    def replica(self, rank: int) -> int:
        return self.infos[rank].dp_rank

    def replicas_text(self, ranks) -> str:
        """'replica 1 (ranks 2, 3)' for a set of ranks, grouped by replica."""
        by_replica: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_replica.setdefault(self.replica(rank), []).append(rank)
        return "; ".join(f"replica {d} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                         for d, rs in sorted(by_replica.items()))
