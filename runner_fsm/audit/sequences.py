"""Per step and group instance, do the members issue the same collectives? (`collective_mismatch`)

Unlike a flight recorder, which pairs collectives by their position in each rank's stream,
every record here carries the step id it was issued for, so a replica that skipped (or
added) one is named with its step, not found hours later as a shape mismatch.

The reference sequence is the members' majority; a tie goes to the sequence most often
agreed in earlier steps (the run's template: drafting adds the same phases every step), then
to the longer one (a skip is likelier than an invention). A member whose sequence is a prefix
of the reference and whose log ends or faults in this step was cut short, not out of step:
its `hang` or `fault` verdict tells that story. When every member stops in the step (a
deadlock, a killed job), no sequence is finished, so each is judged against the run's usual
step alone.

`pg_seq` is checked here too (`agreed_mismatch`): members with matching sequences must also
agree on the count of collectives their group has run. Once a member is known to be out of
step (a mismatch, a missed step), its new offset is accepted silently, so one skip is one
verdict, not one per step for the rest of the run.
"""

from __future__ import annotations

import collections
from typing import Callable

from runner_fsm.audit.collective_labels import key_label, phase_label, sequence_label
from runner_fsm.audit.groups import Groups
from runner_fsm.audit.stepsummary import RankStep
from runner_fsm.audit.verdicts import Verdict


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
    """The rank's log ends, or it faulted, in this step: its sequence may be unfinished."""
    return summary.ended or summary.fault is not None


def describe(group: str, sequence: tuple, reference: tuple) -> str:
    """How `sequence` departs from `reference`, e.g. 'skipped all_reduce DRAFT_PREFILL [[7, 2]]
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
