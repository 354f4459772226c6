"""The ranks of a run as the rules see them: each rank's coordinates, groups and host
(`RankInfo`, found by `replay.discover`), and which ranks must issue the same collectives.

- `Groups`: which ranks must issue the same collectives. A rank's instance of a group is the
  member list a `job` record gives for it (its own, or a peer's that lists it), else the
  layout's: `dp`, `pp`, `pcp` and `tp` are the ranks that differ from it in that dimension
  alone (the DP agreement's group is one per (pp, pcp, tp)), anything else (`expert`, ...)
  one group over every rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runner_fsm.agree.order import last_phase
from runner_fsm.audit.ranklog import SegmentFile
from runner_fsm.audit.shape import DIMENSIONS, Coords, JobShape


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
    # K, the drafter's tokens per step, where the `job` record names it (`num_speculative_tokens`,
    # the vLLM worker's): it bounds the phases of a step (`agree.order`, rule 0).
    spec_tokens: int | None = None
    # its log's kept segments, in order (one: a log without a cap), and the steps rotated away
    segments: tuple[SegmentFile, ...] = dataclasses.field(default=(), compare=False)
    rotated: tuple[tuple[int, int], ...] = ()
    run_id: str | None = None  # as its `job` record names it

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


def job_last_phase(infos) -> int | None:
    """The last phase of a step (`agree.order.last_phase`), when every log names the same
    drafter K; None (unknown) otherwise."""
    ks = {info.spec_tokens for info in infos}
    return last_phase(ks.pop()) if len(ks) == 1 and None not in ks else None


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

    @property
    def last_phase(self) -> int | None:
        return job_last_phase(self.infos.values())

    def replicas_text(self, ranks) -> str:
        """'replica 1 (ranks 2, 3)' for a set of ranks, grouped by replica."""
        by_replica: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_replica.setdefault(self.replica(rank), []).append(rank)
        return "; ".join(f"replica {d} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                         for d, rs in sorted(by_replica.items()))
