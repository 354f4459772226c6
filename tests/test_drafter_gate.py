"""The drafter's gate (`decisions.GATE_EVENT`): where the TP ranks of a replica decide otherwise
whether the drafter runs (vLLM #49027), the rank that drafts waits in a collective its peer
never joins, and no `finish` of that step carries its digest. Replay names the divergence from
the `gate` records each rank wrote before the drafter's collectives (synthetic logs here; the
vLLM run is tests/test_vllm_tp_mtp.py).
"""

from __future__ import annotations

import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.decisions import DecisionLog, StepDecisions
from runner_fsm.replay.judge import replay
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.common import inject

GATE_STEP = 3


def _write_rank(run_dir, tp: int, tp_size: int, *, gate_at_fault: int | None, finishes: bool, gate_logged=True):
    """One TP rank: steps 0..2 decode and draft alike; at GATE_STEP its gate says `gate_at_fault`
    and it ends the step (`finishes`) or its log ends there (waiting in the drafter)."""
    shape = job_shape_fields(1, 1, 0, 0, tp_size=tp_size, tp_rank=tp)
    with AuditLog(run_dir, "run-gate", tp, 0, 0, shape=shape) as log:
        decisions = DecisionLog()
        log.transition(-1, "capture", "init", "capturing", "ok")
        log.transition(-1, "captured", "capturing", "ready", "ok")
        for step in range(GATE_STEP + 1):
            log.transition(step, "decode", "ready", "decode", "ok")
            steps = 1 if step < GATE_STEP else gate_at_fault
            if gate_logged or step < GATE_STEP:
                log.gate(step, steps)
            if step == GATE_STEP and not finishes:
                return
            if steps:
                log.transition(step, "draft", "decode", "draft_sync", "ok")
            log.transition(step, "finish", "draft_sync" if steps else "decode", "ready", "ok",
                           decisions.entry(StepDecisions(True, 99, 4, 4, 0, steps, 1000 + step)))
        log.stop(GATE_STEP, "shutdown", detail="test")


def _run(tmp_path, tp_size: int, skipper: int, *, skipper_logs_gate=True):
    """The skipper's gate says 0 and it ends the step; its peers' say 1 and they wait."""
    for tp in range(tp_size):
        _write_rank(tmp_path, tp, tp_size, gate_at_fault=0 if tp == skipper else 1, finishes=tp == skipper,
                    gate_logged=skipper_logs_gate or tp != skipper)
    return replay(tmp_path)


def _divergences(report):
    return [(v.replica, v.step, v.ranks) for v in report.verdicts if v.kind == "replica_divergence"]


@pytest.mark.parametrize("skipper", [0, 2])
def test_a_rank_whose_gate_says_no_is_named_by_the_majority(tmp_path, skipper):
    """TP=3, the first and the last rank skipping: named alone (a majority of two drafted),
    at its step, the decision `draft`; the peers that waited are the hangs. Mutation: the gate
    compared only among ranks that ended the step -> no finding."""
    report = _run(tmp_path, 3, skipper)
    assert _divergences(report) == [(0, GATE_STEP, (skipper,))], report.format()
    (verdict,) = [v for v in report.verdicts if v.kind == "replica_divergence"]
    assert f"decided draft=0 where" in verdict.detail and "gate" in verdict.detail, verdict.detail
    waiting = {r for v in report.verdicts if v.kind != "replica_divergence" for r in v.ranks}
    assert skipper not in waiting, report.format()


def test_two_ranks_name_both_and_say_which_is_wrong_is_not_known(tmp_path):
    """TP=2, rank 1 skipping (the Done-when's shape): replica 0, step 3, both ranks named."""
    report = _run(tmp_path, 2, 1)
    assert _divergences(report) == [(0, GATE_STEP, (0, 1))], report.format()
    assert "which one is wrong is not known" in report.verdicts[[v.kind for v in report.verdicts].index(
        "replica_divergence")].detail


def test_without_the_skippers_gate_record_nothing_is_claimed(tmp_path):
    """Evidence missing: the skipper's log has no gate record at the step (a runner whose
    drafter is not gated): the peers' gates alone compare nothing, and the skipper's digest has
    no peer digest to meet. Replay names the ranks that never ended the step, not a divergence.
    Mutation: a missing gate read as 0 -> a divergence claimed without evidence."""
    report = _run(tmp_path, 3, 1, skipper_logs_gate=False)
    assert _divergences(report) == [], report.format()
    assert not report.sound


def test_clean_gates_replay_sound(tmp_path):
    """Every rank's gate says 1 and every rank ends every step: sound, and the gate records
    read back. Mutation: the scanner taking a gate from another step -> findings."""
    for tp in range(2):
        _write_rank(tmp_path, tp, 2, gate_at_fault=1, finishes=True)
    report = replay(tmp_path)
    assert report.sound, report.format()
    gates = [r for r in read_records(tmp_path / "rank-1.jsonl") if r["event"] == "gate"]
    assert [(r["step_id"], r["draft"]) for r in gates] == [(s, 1) for s in range(GATE_STEP + 1)]


def test_tp_skip_draft_parses_with_its_rank_and_acts_on_that_rank_only():
    injection = inject.parse("tp-skip-draft@replica=0,step=5,rank=1")
    assert (injection.kind, injection.replica, injection.step, injection.rank) == ("tp-skip-draft", 0, 5, 1)
    with pytest.raises(ConfigError, match="rank=K"):
        inject.parse("tp-skip-draft@replica=0,step=5")
    fired = []
    on_rank = {rank: inject.VLLMInjector(injection, 0, rank=rank, on_fire=lambda r=rank: fired.append(r))
               for rank in (0, 1)}
    assert [on_rank[r].due("tp-skip-draft", 5) for r in (0, 1)] == [False, True] and fired == [1]
    assert on_rank[0].never_fired(9) is None and on_rank[1].never_fired(9) is None
    assert "rank=1" in inject.VLLMInjector(injection, 0, rank=1).never_fired(3)
