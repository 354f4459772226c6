"""Which collective a rank stopped in, and whose fault that was (`hang`).

A rank hangs when its log ends on a collective `enqueue` with no `done` (the writer logs
`enqueue` before the collective starts, DESIGN section 7), or when its last step faulted
with a timeout while a collective was still open. Each peer in that collective's group is
then past it (its `done` is logged), waiting in it too, or to blame:
- it never reached the step, or reached it and did not issue the collective;
- it failed inside the collective, or faulted before it, with an error of its own;
- it waits in a collective of a later phase: it skipped this one. Phases run in order
  within a step (TARGET, DRAFT_PREFILL, DRAFT_DECODE), so of two ranks waiting for each
  other the one in the later phase is the one that skipped ahead.
The replica to blame is the culprit the verdict names; one verdict per step and culprit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from runner_fsm.audit.collective_labels import label
from runner_fsm.audit.groups import Groups
from runner_fsm.audit.merge import StepMerger
from runner_fsm.audit.stepsummary import RankStep
from runner_fsm.audit.verdicts import RELAYED_FAULTS, Verdict


@dataclasses.dataclass
class _Hang:
    """One collective that ranks stopped in, as seen from every rank waiting in it."""

    group: str
    op: object
    phase: object
    occurrence: int  # among the collectives (op, phase) of the group in this step
    waiting: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> its pg_seq
    past: set[int] = dataclasses.field(default_factory=set)
    blamed: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> why
    timed_out: bool = False

    @property
    def name(self) -> str:
        return label(self.group, self.op, self.phase)


def check_hangs(step: int, present: dict[int, RankStep], groups: Groups, merger: StepMerger,
                emit: Callable[[Verdict], None]) -> None:
    hangs: dict[tuple, _Hang] = {}
    for rank, summary in present.items():
        if summary.hang is not None:
            _add_waiter(hangs, step, rank, summary, present, groups, merger)
    by_culprit: dict[tuple[int, ...], list[_Hang]] = {}
    for hang in hangs.values():
        culprits = tuple(sorted(hang.blamed)) or tuple(sorted(hang.waiting))
        by_culprit.setdefault(culprits, []).append(hang)
    for culprits, found in by_culprit.items():  # a deadlock's two collectives: one finding
        emit(_verdict(step, culprits, found, groups))


def _positions(summary: RankStep, group: str, op, phase) -> list[int]:
    """Indices, in `group`'s issue order, of the collectives (op, phase) of this step."""
    return [i for i, key in enumerate(summary.keys(group)) if key[0] == op and key[1] == phase]


def _add_waiter(hangs, step, rank, summary: RankStep, present, groups: Groups, merger: StepMerger) -> None:
    group, index, pg_seq = summary.hang
    op, phase, _ = summary.keys(group)[index]
    occurrence = _positions(summary, group, op, phase).index(index)
    # The DP group of each PCP rank waits in "the same" agreement: one finding per collective.
    hang = hangs.setdefault((group, op, phase, occurrence), _Hang(group, op, phase, occurrence))
    hang.waiting[rank] = pg_seq
    hang.timed_out |= summary.hang_timed_out
    for peer in groups.members(group, groups.instance(group, rank)):
        if peer != rank:
            _place_peer(hang, rank, summary, peer, present.get(peer), step, merger)


def _place_peer(hang: _Hang, rank, summary: RankStep, peer, peer_summary: RankStep | None, step,
                merger: StepMerger) -> None:
    if peer_summary is None:
        hang.blamed[peer] = merger.whereabouts(peer, step)
        return
    same = _positions(peer_summary, hang.group, hang.op, hang.phase)
    own_fault = _own_fault(peer_summary)
    if len(same) > hang.occurrence:
        if peer_summary.done(hang.group, same[hang.occurrence]):
            hang.past.add(peer)
        elif own_fault is not None and peer_summary.hang is None:
            hang.blamed[peer] = f"it failed inside it: {own_fault}"
        else:
            hang.waiting.setdefault(peer, None)
        return
    if peer_summary.hang is not None:
        _place_stuck_peer(hang, rank, summary, peer, peer_summary)
    elif own_fault is not None:
        hang.blamed[peer] = f"it faulted before it: {own_fault}"
    else:
        hang.blamed[peer] = "it reached the step but did not issue it"


def _place_stuck_peer(hang: _Hang, rank, summary: RankStep, peer, peer_summary: RankStep) -> None:
    """The peer waits in another collective D of the same step: who skipped what?"""
    group, index, pg_seq = peer_summary.hang
    op, phase, _ = peer_summary.keys(group)[index]
    other = f"{label(group, op, phase)} (pg_seq {pg_seq})"
    if _later(phase, hang.phase):
        hang.blamed[peer] = f"it skipped ahead to {other}"
    elif _later(hang.phase, phase) and len(_positions(summary, group, op, phase)) <= \
            _positions(peer_summary, group, op, phase).index(index):
        # we are the ones ahead: this waiter never issued D, in which the peer waits for it
        hang.blamed[rank] = f"it skipped {other}, in which its peers wait, and went on to this one"
    else:
        hang.blamed[peer] = f"it is stuck in {other} of the same step"


def _later(phase, than) -> bool:
    return isinstance(phase, int) and isinstance(than, int) and phase > than


def _own_fault(summary: RankStep) -> str | None:
    """The step's fault when it is the rank's own (not relayed from a peer)."""
    if summary.fault is None or summary.fault[0] in RELAYED_FAULTS:
        return None
    return summary.fault[0]


def _verdict(step: int, culprits: tuple[int, ...], hangs: list[_Hang], groups: Groups) -> Verdict:
    parts = []
    for hang in hangs:
        waiting = sorted({groups.replica(r) for r in hang.waiting})
        past = sorted({groups.replica(r) for r in hang.past})
        how = "timed out" if hang.timed_out else "stopped"
        parts.append(f"replica(s) {_ids(waiting)} {how} waiting in {hang.name} ({_pg_text(hang, groups)})"
                     f" at step {step}; to blame: {_blamed_text(hang, groups)}; already past it: {_ids(past) or 'none'}")
    culprit = min(groups.replica(r) for r in culprits)
    return Verdict("hang", culprit, step, "; and ".join(parts), culprits)


def _pg_text(hang: _Hang, groups: Groups) -> str:
    by_replica = {groups.replica(r): pg for r, pg in sorted(hang.waiting.items()) if pg is not None}
    if len(set(by_replica.values())) == 1:
        return f"pg_seq {next(iter(by_replica.values()))}"
    return "pg_seq " + ", ".join(f"{pg} on replica {replica}" for replica, pg in sorted(by_replica.items()))


def _ids(replicas) -> str:
    return ", ".join(map(str, sorted(replicas)))


def _blamed_text(hang: _Hang, groups: Groups) -> str:
    if not hang.blamed:
        return "nobody (every member issued it; killed mid-collective, or its `done` records are lost)"
    by_reason: dict[tuple[int, str], None] = {}
    for peer, reason in sorted(hang.blamed.items()):
        by_reason[(groups.replica(peer), reason)] = None
    return "; ".join(f"replica {replica} ({reason})" for replica, reason in by_reason)
