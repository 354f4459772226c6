"""A replica agrees with itself (DESIGN section 11), judged once per merged step.

- `replica_divergence`: the ranks of a replica logged different decision digests
  (`audit.decisions`) for one step. Among the ranks of one pipeline stage (its TP and PCP
  peers) every decision must match; across stages only `decisions.PP_SHARED` (a stage's rows,
  drafter and sampler are its own), compared on the decisions themselves. The finding names
  the first rank that differs from the replica's reference and the first decision that
  differs, by the rules the online check applies too (`decisions.outvoted`,
  `decisions.first_difference`); a digest that differs while every decision agrees is the
  sampled tokens.
- `graph_mode_demoted`: an idle replica proposed eager to the target agreement while every
  replica with work proposed a graph and the idle one had captured a graph that fits: the
  agreement's minimum pulled every replica out of graph mode for the step (vllm-ascend
  #15347: an idle rank's dummy reported "no graph"). A silent slowdown, not a hang: a finding.

The drafter's gate (`decisions.GATE_EVENT`) is compared first, among the ranks of a stage that
logged it, whether or not they ended the step: a replica whose gates disagree is named there
(`replica_divergence`, decision `draft`), and its digests are not compared again for that step.

One finding per fact: sampled tokens that differ between PCP peers (ranks of one stage and one
TP rank) are `pcp_divergence`, whether the PCP ranks' output digests showed it (the embedded
engine's `pcp all_gather`: `crossrank.check_outputs` named it already) or only the decision
digests do (the vLLM worker logs no output digest); `replica_divergence` is every other
decision, and the sampled tokens of TP peers. A divergence that persists (the same rank and
decision, step after step) is one finding, at its first step.
"""

from __future__ import annotations

import collections
from typing import Callable

from runner_fsm.audit.decisions import FIELDS, PP_SHARED, TOKENS, first_difference, outvoted
from runner_fsm.rules.rank_steps import RankStep
from runner_fsm.rules.ranks import Groups
from runner_fsm.rules.verdicts import Verdict

_GRAPH_EAGER, _GRAPH_FULL = 0, 2  # `dp.GRAPH_EAGER`, `dp.GRAPH_FULL` (replay imports no runtime)


class ReplicaConsensus:
    """The consensus checks over merged steps; `check(step, present, pcp_diverged)` each step."""

    def __init__(self, groups: Groups, emit: Callable[[Verdict], None]):
        self.groups = groups
        self.emit = emit
        self._ongoing: dict[int, tuple] = {}  # replica -> (step, rank, decision) of its last divergence

    def check(self, step: int, present: dict[int, RankStep], pcp_diverged: set[int] = frozenset()) -> None:
        """`pcp_diverged`: replicas `pcp_divergence` was found for at this step already."""
        by_replica: dict[int, dict[int, RankStep]] = collections.defaultdict(dict)
        gated: dict[int, dict[int, RankStep]] = collections.defaultdict(dict)
        for rank, summary in present.items():
            if summary.decided[0] is not None:
                by_replica[self.groups.replica(rank)][rank] = summary
            if summary.decided[3] is not None:
                gated[self.groups.replica(rank)][rank] = summary
        for replica, summaries in gated.items():
            if len(summaries) > 1 and self._gates(step, replica, summaries):
                by_replica.pop(replica, None)  # one finding per fact: the gate named it
        for replica, summaries in by_replica.items():
            if len(summaries) > 1:
                self._replica(step, replica, summaries, pcp_diverged)
        self._demoted(step, present)

    # -- the drafter's gate -------------------------------------------------------------------

    def _gates(self, step: int, replica: int, summaries: dict[int, RankStep]) -> bool:
        """The ranks of one stage that logged their drafter's gate must have let the same number
        of drafter steps run. Judged even where a rank never ended the step: the rank whose
        drafter ran waits in a collective its peer never joins (vLLM #49027), and its gate
        record, written before that collective, is the evidence. True when it named one."""
        stages: dict[int, dict[int, int]] = collections.defaultdict(dict)
        for rank, summary in summaries.items():
            stages[self.groups.infos[rank].pp_rank][rank] = summary.decided[3]
        for gates in stages.values():
            reference, odd, majority = outvoted(gates)
            if odd is not None:
                self._ongoing[replica] = (step, odd, "draft")
                infos = self.groups.infos
                whose = "" if majority else " (no majority among its ranks: which one is wrong is not known)"
                self.emit(Verdict("replica_divergence", replica, step,
                                  f"replica {replica}, {infos[odd].rank_text()} decided draft={gates[odd]} where"
                                  f" {infos[reference].rank_text()} decided draft={gates[reference]} at its drafter's"
                                  f" gate, step {step}{whose}: the ranks that draft wait in the drafter's collectives"
                                  f" for the others; gates: " + ", ".join(f"rank {r}: {g}" for r, g in sorted(gates.items())),
                                  (odd,) if majority else tuple(sorted((odd, reference)))))
                return True
        return False

    # -- replica_divergence -----------------------------------------------------------------

    def _replica(self, step: int, replica: int, summaries: dict[int, RankStep], pcp_diverged) -> None:
        stages: dict[int, dict[int, RankStep]] = collections.defaultdict(dict)
        for rank, summary in summaries.items():
            stages[self.groups.infos[rank].pp_rank][rank] = summary
        if all(len({s.decided[0] for s in stage.values()}) == 1 for stage in stages.values()) and len(stages) == 1:
            self._ongoing.pop(replica, None)  # the common case: one digest, one stage
            return
        found = None
        references = {}
        for pp in sorted(stages):
            reference, odd, majority = outvoted({rank: s.decided[0] for rank, s in stages[pp].items()})
            references[pp] = reference
            if odd is not None and found is None:
                decision = first_difference(stages[pp][odd].decided[1], stages[pp][reference].decided[1], FIELDS)
                found = (odd, reference, decision, majority, "")
                if not majority:
                    found = _eager_beside_a_replay(stages[pp][odd], stages[pp][reference]) or found
        if found is None and len(stages) > 1:
            found = self._across_stages(stages, references)
        if found is None:
            self._ongoing.pop(replica, None)
            return
        odd, reference, decision, majority, because = found
        previous = self._ongoing.get(replica)
        self._ongoing[replica] = (step, odd, decision[0])
        if previous is not None and previous[0] == step - 1 and previous[1:] == (odd, decision[0]):
            return  # the same divergence as at the step before: one finding
        self._emit(step, replica, summaries, odd, reference, decision, majority, pcp_diverged, because)

    def _across_stages(self, stages: dict[int, dict[int, RankStep]], references: dict[int, int]):
        first = min(stages)
        base = stages[first][references[first]].decided[1]
        for pp in sorted(stages)[1:]:
            rank = references[pp]
            mine = stages[pp][rank].decided[1]
            if base and mine:
                decision = first_difference(mine, base, PP_SHARED, known_only=True)
                if decision is not None:
                    return rank, references[first], decision, True, ""
        return None

    def _emit(self, step, replica, summaries, odd, reference, decision, majority, pcp_diverged, because="") -> None:
        """`because`: why `odd` is the one named where no majority says so (`_eager_beside_a_replay`)."""
        name, mine, theirs = decision
        infos = self.groups.infos
        if name == TOKENS and _pcp_peers(infos[odd], infos[reference]):
            if replica in pcp_diverged:
                return  # the PCP ranks' output digests named it already
            self.emit(Verdict("pcp_divergence", replica, step, f"the PCP ranks of replica {replica} sampled"
                              f" different tokens at step {step} (decision digests: {_digests(summaries)})",
                              tuple(sorted(summaries))))
            return
        what = (f"sampled other tokens than {infos[reference].rank_text()}" if name == TOKENS else
                f"decided {name}={mine} where {infos[reference].rank_text()} decided {name}={theirs}"
                if name is not None else f"logged another decision digest than {infos[reference].rank_text()}"
                " (the decision that differs was logged before the steps read)")
        what += because
        whose = "" if majority else " (no majority among its ranks: which one is wrong is not known)"
        self.emit(Verdict("replica_divergence", replica, step,
                          f"replica {replica}, {infos[odd].rank_text()} {what} at step {step}{whose};"
                          f" decision digests: {_digests(summaries)}",
                          (odd,) if majority else tuple(sorted((odd, reference)))))

    # -- graph_mode_demoted -------------------------------------------------------------------

    def _demoted(self, step: int, present: dict[int, RankStep]) -> None:
        proposals: dict[int, tuple] = {}
        for rank, summary in present.items():
            proposed = summary.decided[2]
            if proposed is not None:
                proposals.setdefault(self.groups.replica(rank), (*proposed, rank))
        busy = [p for p in proposals.values() if isinstance(p[0], int) and p[0] > 0]
        if not busy or any(p[1] != _GRAPH_FULL for p in busy):
            return  # nobody had work, or one with work could not replay: eager was due
        widest = max(p[0] for p in busy)
        demoters = sorted(replica for replica, (n, mode, captured, _) in proposals.items()
                          if n == 0 and mode == _GRAPH_EAGER and isinstance(captured, int) and captured >= widest)
        if not demoters:
            return
        first = demoters[0]
        others = ", ".join(map(str, sorted(set(proposals) - set(demoters))))
        self.emit(Verdict("graph_mode_demoted", first, step,
                          f"idle replica {first} proposed eager to the target agreement at step {step} although it"
                          f" had captured a graph of {proposals[first][2]} rows (>= the widest batch, {widest}),"
                          f" while replica(s) {others} with work proposed a graph: the agreement's minimum ran every"
                          " replica eager" + (f" (idle replicas proposing eager: {', '.join(map(str, demoters))})"
                                              if len(demoters) > 1 else ""),
                          tuple(proposals[r][3] for r in demoters)))


def _eager_beside_a_replay(a: RankStep, b: RankStep):
    """Where no majority says which of two ranks is wrong: the one that ran eager the batch its peer
    replayed as a graph of G rows, though it had captured a graph of G rows itself (a rank's graph
    decision is vLLM's dispatch over the batch, and every decision before it matched), is (odd,
    reference, ("graph", 0, G), True, why in words). None where that evidence is not there."""
    mine, theirs = a.decided[1] or {}, b.decided[1] or {}
    if any(mine.get(name) != theirs.get(name) for name in ("real", "batch", "dispatch")):
        return None  # another batch: not the same dispatch
    for eager, replayed in ((a, b), (b, a)):
        size = (replayed.decided[1] or {}).get("graph")
        if (eager.decided[1] or {}).get("graph") == 0 and isinstance(size, int) and size > 0 \
                and size in eager.decided[4]:
            return eager.rank, replayed.rank, ("graph", 0, size), True, (
                f" (it ran eager the batch its peer replayed, though it had captured that graph,"
                f" {size} rows, itself)")
    return None


def _pcp_peers(a, b) -> bool:
    return a.pp_rank == b.pp_rank and a.tp_rank == b.tp_rank and a.pcp_rank != b.pcp_rank


def _digests(summaries: dict[int, RankStep]) -> str:
    return ", ".join(f"rank {rank}: {s.decided[0]:#010x}" for rank, s in sorted(summaries.items()))
