"""Where every rank last was, kept in the job's key-value store, to name a culprit.

gloo cannot say which member of a group never joined a collective. So each rank writes
its position (step, and the collective it is entering, or that it is between collectives)
into the c10d store that the process group already runs. When a collective times out,
the rank reads every position and names the replica that is not where its peers are:
- a replica waiting in a collective of a phase past the last of a step (when the drafter's K
  is known: `agree.order`, rule 0) ran a draft pass its peers never run;
- a replica outside any collective while its peers wait inside one never arrived (it hung,
  faulted or died);
- when every replica waits, the rule of `agree.order` (shared with `dp.agree` and replay)
  over where each waits (step, phase, the agreement before the forward): the replicas off a
  strict majority's position; else, between two positions, the one further along ran past a
  collective its peers are still in; else a tie, and no replica stands out.
"""

from __future__ import annotations

import dataclasses
import datetime

from runner_fsm.agree.order import out_of_order, past_last_phase
from runner_fsm.config import ParallelLayout

_KEY = "runner_fsm/position/{rank}"


@dataclasses.dataclass(frozen=True)
class Position:
    """One rank's last position; `collective` is empty between collectives."""

    rank: int
    step: int
    phase: int
    collective: str

    @property
    def order(self) -> tuple[int, int, int]:
        """Where in a step: phases in order, and in a phase the agreement before the forward."""
        return (self.step, self.phase, 0 if self.collective.startswith("dp ") else 1)

    def encode(self) -> bytes:
        return f"{self.step}|{self.phase}|{self.collective}".encode()

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> "Position":
        step, phase, collective = raw.decode().split("|", 2)
        return cls(rank, int(step), int(phase), collective)


class Heartbeat:
    """Writes this rank's position; on a timeout, reads everyone's and names the culprit."""

    def __init__(self, store, layout: ParallelLayout, global_rank: int, *, last_phase: int | None = None):
        self.store = store
        self.layout = layout
        self.rank = global_rank
        self.last_phase = last_phase  # the last phase of a step, when the drafter's K is known

    def beat(self, step: int, phase: int = 0, collective: str = "") -> None:
        self.store.set(_KEY.format(rank=self.rank), Position(self.rank, step, phase, collective).encode())

    def positions(self) -> dict[int, Position]:
        keys = [_KEY.format(rank=r) for r in range(self.layout.world_size)]
        self.store.set_timeout(datetime.timedelta(seconds=2))
        found = {}
        for rank, key in enumerate(keys):
            if self.store.check([key]):
                found[rank] = Position.decode(rank, self.store.get(key))
        return found

    def describe(self) -> str:
        """A sentence naming the replicas out of step (or why it cannot tell)."""
        try:
            positions = self.positions()
        except Exception as exc:  # the store lives in rank 0: if rank 0 died, so did it
            # Its server runs on a thread of rank 0's process, so it answers while rank 0 hangs:
            # unreachable, the process is gone, and its replica is the one to name.
            replica = self.layout.coords(0)[0]
            return (f"culprit: replica {replica} (the job's store, held by rank 0, is unreachable:"
                    f" rank 0 is gone; {type(exc).__name__}: {exc})")
        return describe_positions(positions, self.layout, last_phase=self.last_phase)


def describe_positions(positions: dict[int, Position], layout: ParallelLayout, *,
                       last_phase: int | None = None) -> str:
    per_replica = {}
    for pos in positions.values():
        per_replica.setdefault(layout.coords(pos.rank)[0], []).append(pos)
    seen = "; ".join(
        f"replica {d}: " + ", ".join(f"rank {p.rank} step {p.step} {p.collective or 'outside collectives'}"
                                     for p in sorted(ps, key=lambda p: p.rank))
        for d, ps in sorted(per_replica.items()))
    silent = sorted(set(range(layout.dp_size)) - set(per_replica))
    culprits = sorted(set(silent) | set(_culprits(positions, layout, last_phase)))
    verdict = (f"culprit: replica {', '.join(map(str, culprits))}" if culprits
               else "no replica stands out")
    return f"{verdict} ({seen})"


def _culprits(positions: dict[int, Position], layout: ParallelLayout, last_phase: int | None = None) -> list[int]:
    """Replicas waiting in a phase past the step's last; else replicas outside any collective
    while others wait in one; else, when every replica waits, the ones out of order (`agree.order`)."""
    outside, furthest, beyond = set(), {}, set()
    for p in positions.values():
        replica = layout.coords(p.rank)[0]
        furthest[replica] = max(furthest.get(replica, p.order), p.order)
        if not p.collective:
            outside.add(replica)
        elif past_last_phase(p.phase, last_phase):
            beyond.add(replica)
    if not furthest or len(outside) == len(furthest):
        return []
    if beyond and len(beyond) < len(furthest):
        return sorted(beyond)
    if outside:
        return sorted(outside)
    # Every replica waits: the rule the DP agreement names its culprit by (`agree.order`),
    # over where each one waits: a strict majority, else the side ahead, else nobody (a tie).
    found = out_of_order(furthest)
    return list(found.culprits) if found is not None else []
