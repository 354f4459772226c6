"""Did every rank reach the same DP agreement? (`agreed_mismatch`, when the log carries it)

`DPSyncState` is identical on every replica by contract (DESIGN section 5), and the PCP ranks
of a replica send the same column, so for one step and phase every rank of the run must have
agreed on the same state. The writer logs it, when it does, as `agreed` on the `done` record
of a `dp` collective, with `DPSyncState`'s field names. Ties go to the lowest rank's value,
as `dp.agree` breaks ties.
"""

from __future__ import annotations

import collections
from typing import Callable

import orjson

from runner_fsm.audit.checks import own_agreement_problem
from runner_fsm.audit.collective_labels import label, phase_label
from runner_fsm.audit.groups import Groups
from runner_fsm.audit.stepsummary import RankStep
from runner_fsm.audit.verdicts import Verdict

AGREED_FIELDS = ("step_id", "phase", "num_tokens_across_dp", "graph_mode", "uniform_token_count",
                 "num_reqs", "all_idle")


def check_own_agreement(pending: tuple, agreed: dict, step: int, dp_rank: int) -> list[str]:
    """What one rank's logged agreement contradicts in its own records (empty when sound).

    `pending` is the collective as the scanner keeps it: (group, index, op, phase, pg_seq,
    line, sent). The rule is `checks.own_agreement_problem`, the one the runner applies online.
    """
    group, _, op, phase, _, _, sent = pending
    try:
        sent_tokens = sent["num_tokens"] if sent is not None else None
        got = agreed["num_tokens_across_dp"][dp_rank]
    except (KeyError, IndexError, TypeError):
        sent_tokens = got = None
    problem = own_agreement_problem(step, phase, sent_tokens, agreed.get("step_id"), agreed.get("phase"),
                                    got, agreed.get("graph_mode"))
    if problem is None:
        return []
    return [f"{label(group, op, phase)} logged at step {step}: replica {dp_rank} {problem}"]


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
