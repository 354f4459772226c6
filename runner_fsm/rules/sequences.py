"""Which collectives each member of a group issued in a step (`collective_mismatch`), and which
one ranks stopped in, by whose fault (`hang`).

Unlike a flight recorder, which pairs collectives by their position in each rank's stream,
every record here carries the step id it was issued for, so a replica that skipped (or added)
one is named with its step and the counts per phase, not found hours later as a shape
mismatch. The reference sequence is the members' majority; a tie goes to the sequence most
often agreed in earlier steps (the run's template), then to the longer one (a skip is likelier
than an invention). A member whose sequence is a prefix of the reference and whose log ends
or faults in this step was cut short, not out of step: its `hang` verdict tells that story.
When every member stops in the step (a deadlock, a killed job), each is judged against the
run's usual step alone. `pg_seq` is checked here too (`agreed_mismatch`): members with
matching sequences must also agree on the count of collectives their group has run; once a
member is known to be out of step its new offset is accepted, so one skip is one verdict.

A rank hangs when its log ends on a collective `enqueue` with no `done` (the writer logs
`enqueue` before the collective starts, DESIGN section 7), or when its last step still has a
collective open. Each peer in that collective's group is then past it (its `done` is logged),
waiting in it too, or to blame: it never reached the step, or reached it and did not issue the
collective; it failed inside it or before it; or it waits in a collective of a later phase
(phases run in order within a step, so of two ranks waiting for each other the one in the
later phase skipped ahead). One verdict per step and culprit.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from runner_fsm.agree.order import past_last_phase
from runner_fsm.rules.rank_steps import RankStep, StepMerger
from runner_fsm.rules.ranks import Groups
from runner_fsm.rules.verdicts import RELAYED_FAULTS, Verdict, key_label, label, phase_label, sequence_label


class SequenceChecker:
    def __init__(self, groups: Groups, emit: Callable[[Verdict], None]):
        self.groups = groups
        self.emit = emit
        self.template: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._pg_base: dict[tuple, int] = {}  # group instance -> pg_seq its next step starts at
        self._pg_offset: dict[tuple[str, int], int] = {}  # (group, rank) -> accepted drift
        self._resync: set[tuple[str, int]] = set()
        self._instance_cache: dict[tuple, dict[tuple, tuple[int, ...]]] = {}

    def mark_out_of_step(self, rank: int) -> None:
        """`rank` missed a step: its pg_seq counters lag from now on, which is not news."""
        for group in self.template:
            self._resync.add((group, rank))

    def check(self, step: int, present: dict[int, RankStep]) -> None:
        summaries = iter(present.values())
        signature = next(summaries).signature
        if all(other.signature is signature or other.signature == signature for other in summaries):
            # Every rank issued the same collectives: only the counters can still differ.
            for group, keys in signature:
                self.template[group][keys] += 1
                for instance, ranks in self._instances(group, present).items():
                    self._check_pg(step, group, instance, ranks, keys, present)
            return
        names = dict.fromkeys(group for summary in present.values() for group, _ in summary.signature)
        departures: dict[int, list[str]] = {}  # rank -> how it departs, per group
        for group in names:
            for instance, ranks in self._instances(group, present).items():
                sequences = {rank: present[rank].keys(group) for rank in ranks}
                self._check_instance(step, group, instance, sequences, present, departures)
        # One finding per replica and step, however many groups show it (a skipped draft
        # phase is missing from the DP agreements and from the expert exchange alike).
        for rank, parts in departures.items():
            replica = self.groups.replica(rank)
            detail = f"replica {replica} " + "; and ".join(parts) + f" at step {step}"
            self.emit(Verdict("collective_mismatch", replica, step, detail, (rank,)))

    def _instances(self, group: str, present: dict[int, RankStep]) -> dict[tuple, tuple[int, ...]]:
        """The group's instances among the ranks present, memoised by the set of ranks."""
        cache_key = (group, tuple(present))
        found = self._instance_cache.get(cache_key)
        if found is None:
            grouped: dict[tuple, list[int]] = collections.defaultdict(list)
            for rank in present:
                grouped[self.groups.instance(group, rank)].append(rank)
            found = self._instance_cache[cache_key] = {k: tuple(v) for k, v in grouped.items()}
        return found

    def _check_instance(self, step, group, instance, sequences, present, departures) -> None:
        template = self.template[group]
        distinct = set(sequences.values())
        if len(distinct) == 1:
            reference = distinct.pop()
            template[reference] += 1
        elif all(_ends_here(present[rank]) for rank in sequences):
            # Every member stopped in this step (killed, deadlocked): each one's sequence is
            # unfinished, so it can only be judged against the run's usual step.
            usual = template.most_common(1)[0][0] if template else max(distinct, key=len)
            self._depart(group, sequences, usual, present, departures)
            reference = max(distinct, key=len)
        else:
            reference = self._reference(sequences, template)
            self._depart(group, sequences, reference, present, departures)
            template[reference] += 1
        self._check_pg(step, group, instance, tuple(sequences), reference, present)

    def _depart(self, group, sequences, reference, present, departures) -> None:
        """Note each member whose sequence departs from `reference` (a prefix is no departure
        for a member cut short in this step: its `hang` or `fault` verdict tells that story)."""
        for rank, sequence in sequences.items():
            if sequence == reference or (_ends_here(present[rank]) and sequence == reference[: len(sequence)]):
                continue
            self._resync.add((group, rank))
            departures.setdefault(rank, []).append(f"{describe(group, sequence, reference)} in group '{group}'")

    @staticmethod
    def _reference(sequences: dict[int, tuple], template: collections.Counter) -> tuple:
        counts = collections.Counter(sequences.values())
        lowest = {}
        for rank, sequence in sorted(sequences.items(), reverse=True):
            lowest[sequence] = rank
        return max(counts, key=lambda s: (counts[s], template[s], len(s), -lowest[s]))

    def _check_pg(self, step, group, instance, ranks, reference, present) -> None:
        base = self._pg_base.get(instance, 0)
        for rank in ranks:
            pg_seq = present[rank].first_pg_of(group)
            offset = self._pg_offset.get((group, rank))
            if pg_seq is None or (offset is not None and pg_seq == base + offset):
                continue
            self._pg_offset[(group, rank)] = pg_seq - base
            # The first count seen of a rank sets its offset: a scan that starts mid-run
            # (a range of steps) cannot know the counters' earlier history.
            if offset is None or (group, rank) in self._resync:
                self._resync.discard((group, rank))
                continue
            replica = self.groups.replica(rank)
            first = present[rank].keys(group)[0]
            self.emit(Verdict("agreed_mismatch", replica, step, (
                f"replica {replica} issued {key_label(group, first)} in group '{group}' at step {step}"
                f" as pg_seq {pg_seq}, where its peers' count says {base + offset}: the group's"
                " collectives are counted differently on this rank (a collective without a record,"
                " or the group re-created)"), (rank,)))
        self._pg_base[instance] = base + len(reference)


def _ends_here(summary: RankStep) -> bool:
    """The rank's log ends, or its transitions show it faulted, in this step: its sequence may
    be unfinished. (The transitions, not the `fault` record: what it did, not what it said.)"""
    return summary.ended or summary.faulted


def describe(group: str, sequence: tuple, reference: tuple) -> str:
    """How `sequence` departs from `reference`, e.g. 'skipped all_reduce DRAFT_PREFILL [[14]]
    that its peers issued (DRAFT_PREFILL: 0 collectives where its peers ran 1)'."""
    missing = _unmatched(reference, sequence)
    if missing:
        how = f"skipped {', '.join(key_label(group, k) for k in missing)} that its peers issued"
    else:
        extra = _unmatched(sequence, reference)
        if extra:
            how = f"issued {', '.join(key_label(group, k) for k in extra)} that its peers did not"
        else:
            how = f"issued {sequence_label(group, sequence)} where its peers issued {sequence_label(group, reference)}"
    counts = _phase_counts(group, sequence, reference)
    return f"{how} ({counts})" if counts else how


def _phase_counts(group: str, sequence: tuple, reference: tuple) -> str:
    """The phases whose collective counts differ, with both counts."""
    mine, theirs = collections.Counter(k[1] for k in sequence), collections.Counter(k[1] for k in reference)
    phases = [p for p in dict.fromkeys([*theirs, *mine]) if mine[p] != theirs[p]]
    return "; ".join(f"{phase_label(group, p)}: {mine[p]} collective{'s' if mine[p] != 1 else ''}"
                     f" where its peers ran {theirs[p]}" for p in phases)


def _unmatched(longer: tuple, shorter: tuple) -> list | None:
    """The items of `longer` left over when `shorter` is a subsequence of it, else None."""
    if len(shorter) >= len(longer):
        return None
    left, index = [], 0
    for item in longer:
        if index < len(shorter) and item == shorter[index]:
            index += 1
        else:
            left.append(item)
    return left if index == len(shorter) else None


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
    # A replica that sent a non-ok status aborts the step's agreement on every member: the
    # agreement ends in an error there, by design, not in a hang.
    aborted = any(summary.aborted for summary in present.values())
    for rank, summary in present.items():
        if summary.hang is not None and not (aborted and summary.hang[0] == "dp"):
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
    if past_last_phase(phase, groups.last_phase):  # `agree.order`, rule 0: its own extra draft pass
        hang.blamed[rank] = "it waits in a phase past the last of any step of this job: a draft pass its peers do not run"
        return
    for peer in groups.members(group, groups.instance(group, rank)):
        if peer != rank:
            _place_peer(hang, rank, summary, peer, present.get(peer), step, merger)


def _place_peer(hang: _Hang, rank, summary: RankStep, peer, peer_summary: RankStep | None, step,
                merger: StepMerger) -> None:
    if peer_summary is None:
        if not merger.blind(peer, step):  # a log that no longer holds the step says nothing of it
            hang.blamed[peer] = merger.whereabouts(peer, step)
        return
    same = _positions(peer_summary, hang.group, hang.op, hang.phase)
    own_fault = _own_fault(peer_summary)
    if len(same) > hang.occurrence:
        if peer_summary.done(hang.group, same[hang.occurrence]):
            hang.past.add(peer)
        elif peer_summary.faulted and peer_summary.hang is None:
            hang.blamed[peer] = "it failed inside it" + (f": {own_fault}" if own_fault else "")
        else:
            hang.waiting.setdefault(peer, None)
        return
    if peer_summary.hang is not None:
        _place_stuck_peer(hang, rank, summary, peer, peer_summary)
    elif peer_summary.faulted:
        hang.blamed[peer] = "it faulted before it" + (f": {own_fault}" if own_fault else "")
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
    """The step's fault when it is the rank's own (not relayed from a peer): words for the
    verdict's text only; whoever is blamed is blamed for what the records show it did."""
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
    past = tuple(sorted({r for hang in hangs for r in hang.past}))
    return Verdict("hang", culprit, step, "; and ".join(parts), culprits, past=past)


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
