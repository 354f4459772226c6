"""The checks across ranks, run once per merged step: collective sequences and hangs
(`sequences`), the DP agreements paired across steps and their culprit (`pairing`, by the rule
of `dp.agree`), agreements that differ between ranks (`agreed_mismatch`), PCP ranks that
sampled different tokens (`pcp_divergence`), the ranks of a replica that decided otherwise than
their peers and idle replicas that demoted the graph mode (`consensus`), and ranks missing from
a step others agreed on (`missing_replica`).

`DPSyncState` is identical on every replica by contract (DESIGN section 5), and the PCP ranks
of a replica send the same column, so for one step and phase every rank of the run must have
agreed on the same state (the majority's state is the reference, ties to the lowest rank's).
A step that some replicas agreed on while a rank has no record of it at all is a missed step;
consecutive missed steps of one rank make one finding, so a replica that died early is one
verdict, not one per step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import orjson

from runner_fsm.rules.checks import divergent_outputs
from runner_fsm.rules.consensus import ReplicaConsensus
from runner_fsm.rules.pairing import AgreementPairs
from runner_fsm.rules.rank_steps import RankStep, StepMerger
from runner_fsm.rules.ranks import Groups
from runner_fsm.rules.sequences import SequenceChecker, check_hangs
from runner_fsm.rules.verdicts import Verdict, phase_label


@dataclasses.dataclass
class MissedSteps:
    """Consecutive steps that replicas agreed on and `rank` never reached."""

    rank: int
    replica: int
    first: int
    last: int
    agreed_by: set[int]
    whereabouts: str
    open_end: bool = False  # still missing when the steps judged ended
    continued: bool = False  # already missing before the first step judged

    def verdict(self) -> Verdict:
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}..{self.last}"
        agreed = ", ".join(map(str, sorted(self.agreed_by)))
        detail = (f"replica {self.replica} never reached {steps}, which replica(s) {agreed} agreed on"
                  f" ({self.whereabouts})")
        return Verdict("missing_replica", self.replica, self.first, detail, (self.rank,))


class CrossRankChecker:
    def __init__(self, groups: Groups, merger: StepMerger, verdicts: list[Verdict]):
        self.groups = groups
        self.merger = merger
        self.emit = verdicts.append
        self.ranks = tuple(sorted(groups.infos))
        self.sequences = SequenceChecker(groups, self.emit)
        self.pairs = AgreementPairs(groups, self.emit)
        self.consensus = ReplicaConsensus(groups, self.emit)
        self.missed: list[MissedSteps] = []  # closed runs; see finish()
        self._open: dict[int, MissedSteps] = {}

    def check(self, step: int, present: dict[int, RankStep]) -> None:
        for rank, summary in present.items():
            if summary.resumed:  # back after a jump (steps rotated away): its counters moved on
                self.sequences.mark_out_of_step(rank)
        if len(present) < len(self.ranks):
            self._note_absent(step, present)
        if self._open:
            for rank in [r for r in self._open if r in present]:
                self.missed.append(self._open.pop(rank))
        self.sequences.check(step, present)
        self.pairs.check(step, present)
        check_agreed(step, present, self.groups, self.emit)
        self.consensus.check(step, present, check_outputs(step, present, self.groups, self.emit))
        check_hangs(step, present, self.groups, self.merger, self.emit)

    def finish(self) -> list[MissedSteps]:
        """Every run of missed steps, those still open marked `open_end`."""
        for missed in self._open.values():
            missed.open_end = True
            self.missed.append(missed)
        self._open.clear()
        return self.missed

    def _note_absent(self, step: int, present: dict[int, RankStep]) -> None:
        agreed_by = {self.groups.replica(rank) for rank, summary in present.items() if summary.agreed_any("dp")}
        if not agreed_by:
            return
        for rank in self.ranks:
            if rank in present or self.merger.blind(rank, step):  # rotated away: not seen, not missed
                continue
            self.sequences.mark_out_of_step(rank)
            self.pairs.forget(rank)
            missed = self._open.get(rank)
            if missed is None:
                self._open[rank] = MissedSteps(rank, self.groups.replica(rank), step, step, set(agreed_by),
                                               self.merger.whereabouts(rank, step))
            else:
                missed.last = step
                missed.agreed_by |= agreed_by


def check_outputs(step: int, present: dict[int, RankStep], groups: Groups, emit) -> set[int]:
    """`pcp_divergence`: the PCP ranks of a replica logged digests of different sampled tokens;
    returns the replicas it was found for."""
    by_replica: dict[int, dict[int, int]] = {}
    found = set()
    for rank, summary in present.items():
        if summary.output is not None:
            by_replica.setdefault(groups.replica(rank), {})[rank] = summary.output
    for replica, digests in by_replica.items():
        if divergent_outputs(digests) is None:
            continue
        found.add(replica)
        each = ", ".join(f"rank {rank}: {digest:#010x}" for rank, digest in sorted(digests.items()))
        emit(Verdict("pcp_divergence", replica, step, f"the PCP ranks of replica {replica} sampled different"
                     f" tokens at step {step} (output digests {each})", tuple(sorted(digests))))
    return found


def join_missed(runs: list[MissedSteps]) -> list[Verdict]:
    """One verdict per run; a run open at the end of one range of steps and continued at the
    start of the next is one run."""
    joined: list[MissedSteps] = []
    for run in sorted(runs, key=lambda r: (r.rank, r.first)):
        previous = joined[-1] if joined else None
        if previous is not None and previous.rank == run.rank and previous.open_end and run.continued:
            previous.last, previous.open_end = run.last, run.open_end
            previous.agreed_by |= run.agreed_by
        else:
            joined.append(dataclasses.replace(run, agreed_by=set(run.agreed_by)))
    return [run.verdict() for run in joined]


AGREED_FIELDS = ("step_id", "phase", "num_tokens_across_dp", "graph_mode", "uniform_token_count",
                 "num_reqs", "all_idle")


def check_agreed(step: int, present: dict[int, RankStep], groups: Groups,
                 emit: Callable[[Verdict], None]) -> None:
    payloads = {rank: summary.agreed for rank, summary in present.items() if summary.agreed}
    if len(payloads) < 2:
        return
    values = iter(payloads.values())
    first = next(values)
    if all(value == first for value in values):
        return  # the common case costs one comparison per rank
    per_phase: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for rank, got in payloads.items():
        for phase, agreed in got:
            per_phase[phase].setdefault(rank, agreed)
    for phase, per_rank in per_phase.items():
        _compare_phase(step, phase, per_rank, groups, emit)


def _compare_phase(step, phase, per_rank: dict[int, dict], groups: Groups, emit) -> None:
    canonical = {rank: orjson.dumps(agreed, option=orjson.OPT_SORT_KEYS) for rank, agreed in per_rank.items()}
    counts = collections.Counter(canonical.values())
    lowest = {}
    for rank in sorted(canonical, reverse=True):
        lowest[canonical[rank]] = rank
    reference = max(counts, key=lambda key: (counts[key], -lowest[key]))
    expected = per_rank[lowest[reference]]
    for rank, key in canonical.items():
        if key == reference:
            continue
        got = per_rank[rank]
        fields = [f for f in dict.fromkeys([*AGREED_FIELDS, *got, *expected]) if got.get(f) != expected.get(f)]
        diffs = "; ".join(f"{f}={got.get(f)!r} where its peers agreed {f}={expected.get(f)!r}" for f in fields)
        replica = groups.replica(rank)
        emit(Verdict("agreed_mismatch", replica, step,
                     f"replica {replica} agreed at step {step} {phase_label('dp', phase)}: {diffs}", (rank,)))
