"""The reference model under DP=2 x PCP=2 on gloo (4 processes) against one process.

One spawn runs a scripted sequence of steps (spawning costs seconds of CPU per process);
children return their outcomes as data and the parent compares them with single-process
runs of each replica's own batches: prefill, decode, one replica idle while the other works,
graph-mode decode, a replica whose expert header disagrees with the agreement (every rank must
raise, nobody hangs, and the next step works), and a draft step with one replica idle.
"""

from __future__ import annotations

import numpy as np
import pytest

from runner_fsm import dp
from runner_fsm.replica.components import ForwardStep
from runner_fsm.engine.launch import spawn
from runner_fsm.model import DispatchCountError
from runner_fsm.pcp.plan import num_tokens_for_dispatch
from runner_fsm.replica.spec import tokens_per_request

from test_model_support import (
    CAPTURE_SIZES, Sequences, TargetDriver, make_model_dirs, open_drafter, open_target, prompt,
    runner_config,
)

pytestmark = pytest.mark.multiproc

K = 2
# Per step: what replica 0 and replica 1 do.
STEPS = (
    ("prefill", "prefill"),
    ("decode", "decode"),
    ("decode", "idle"),
    ("idle", "decode"),
    ("graph", "graph"),
    ("decode", "bad_count"),  # replica 1 reports one token more than it agreed
    ("decode", "decode"),
    ("draft", "idle"),  # a fresh prompt on replica 0, drafted while replica 1 idles
)
PROMPTS = (
    [prompt(11, 31), prompt(6, 32)],  # replica 0
    [prompt(17, 33)],  # replica 1: one long prompt, split in 4 chunks over its 2 PCP ranks
)
DRAFT_PROMPT = prompt(8, 34)


def _job(groups, target_dir, draft_dir):
    r = groups.dp_rank
    config = runner_config(dp_size=2, pcp_size=2, num_speculative_tokens=K)
    driver = TargetDriver(open_target(target_dir, groups), config, dp_rank=r, pcp_rank=groups.pcp_rank)
    drafter = open_drafter(draft_dir, groups)
    seqs = Sequences(PROMPTS[r])
    outcomes = []
    for step_id, actions in enumerate(STEPS):
        action = actions[r]
        if action == "idle":
            outcomes.append(_idle(groups, driver, drafter, step_id, graph=actions[1 - r] == "graph"))
        elif action == "draft":
            outcomes.append(_draft_step(groups, driver, drafter, step_id))
        else:
            outcomes.append(_real(groups, driver, seqs, step_id, action))
    return outcomes


def _agree(groups, local):
    return dp.sync(groups.dp, local, capture_sizes=CAPTURE_SIZES)


def _real(groups, driver, seqs, step_id, action):
    b = seqs.prefill() if action == "prefill" else seqs.decode()
    agreed = _agree(groups, driver.dispatch(b, step_id, graph=action == "graph"))
    n = num_tokens_for_dispatch(b.num_scheduled, b.is_prefilling, 2)
    try:
        result = driver.run(b, agreed, dispatch_count=n + 1 if action == "bad_count" else None)
    except DispatchCountError as error:
        return ("error", error.replica, error.reported, error.agreed, str(error))
    seqs.advance(b, result.tokens)
    return ("ok", agreed.use_graph, result.tokens, result.logits)


def _idle(groups, driver, drafter, step_id, *, graph: bool):
    mode = dp.GRAPH_FULL if graph else dp.GRAPH_EAGER
    agreed = _agree(groups, dp.LocalDispatch(step_id, dp.TARGET, 0, 0, mode, 0, 0))
    out = driver.run_dummy(agreed)
    if STEPS[step_id][1 - groups.dp_rank] == "draft":
        _draft(groups, drafter, None, None, step_id)
    return ("idle", agreed.use_graph, bool(np.isfinite(out.numpy()).all()))


def _draft_step(groups, driver, drafter, step_id):
    seqs = Sequences([DRAFT_PROMPT], first_req=2)
    b = seqs.prefill()
    result = driver.run(b, _agree(groups, driver.dispatch(b, step_id)))
    sampled = tokens_per_request(result.tokens, b)
    return ("draft", sampled, _draft(groups, drafter, b, sampled, step_id))


def _draft(groups, drafter, b, sampled, step_id):
    """The replica's draft_sync: DRAFT_PREFILL, then K-1 forwards under one DRAFT_DECODE."""
    rows = drafter.prefill_rows(b, sampled) if b is not None else 0
    reqs = b.num_reqs if b is not None else 0
    agreed = _agree(groups, dp.LocalDispatch(step_id, dp.DRAFT_PREFILL, 0, rows, 0, 0, reqs))
    drafter.prefill(b, sampled, ForwardStep(step_id, max(1, rows), agreed, rows, is_dummy=b is None))
    agreed = _agree(groups, dp.LocalDispatch(step_id, dp.DRAFT_DECODE, 0, reqs, 0, 0, reqs))
    for _ in range(K - 1):
        drafter.decode(ForwardStep(step_id, max(1, reqs), agreed, reqs, is_dummy=b is None))
    return drafter.proposals()


def _single_process(target_dir, draft_dir, replica):
    """What replica `replica` computes alone (P=1, one rank): its outcomes, None where idle."""
    driver = TargetDriver(open_target(target_dir), runner_config(num_speculative_tokens=K))
    seqs = Sequences(PROMPTS[replica])
    expected = []
    for step_id, actions in enumerate(STEPS):
        action = actions[replica]
        if action in ("idle", "bad_count") or (action == "decode" and "bad_count" in actions):
            expected.append(None)
        elif action == "draft":
            drafter = open_drafter(draft_dir)
            b = Sequences([DRAFT_PROMPT], first_req=2).prefill()
            result = driver.run(b, driver.agree_alone(b, step_id))
            sampled = tokens_per_request(result.tokens, b)
            expected.append((sampled, _draft_alone(drafter, b, sampled, step_id)))
        else:
            b = seqs.prefill() if action == "prefill" else seqs.decode()
            result = driver.run(b, driver.agree_alone(b, step_id))
            seqs.advance(b, result.tokens)
            expected.append((result.tokens, result.logits))
    return expected


def _draft_alone(drafter, b, sampled, step_id):
    rows = drafter.prefill_rows(b, sampled)
    agreed = dp.agree([dp.LocalDispatch(step_id, dp.DRAFT_PREFILL, 0, rows, 0, 0, b.num_reqs)])
    drafter.prefill(b, sampled, ForwardStep(step_id, rows, agreed, rows))
    agreed = dp.agree([dp.LocalDispatch(step_id, dp.DRAFT_DECODE, 0, b.num_reqs, 0, 0, b.num_reqs)])
    for _ in range(K - 1):
        drafter.decode(ForwardStep(step_id, b.num_reqs, agreed, b.num_reqs))
    return drafter.proposals()


def test_dp2_pcp2_equals_one_process(tmp_path):
    target_dir, draft_dir = make_model_dirs(tmp_path)
    results = spawn(_job, runner_config(dp_size=2, pcp_size=2).layout, target_dir, draft_dir, timeout_s=90)
    by_rank = {(rank // 2, rank % 2): outcomes for rank, outcomes in enumerate(results)}
    for replica in (0, 1):
        expected = _single_process(target_dir, draft_dir, replica)
        for pcp_rank in (0, 1):
            for step_id, (got, want) in enumerate(zip(by_rank[(replica, pcp_rank)], expected)):
                _compare(STEPS[step_id][replica], got, want, where=f"replica {replica} pcp {pcp_rank} step {step_id}")


def _compare(action, got, want, *, where):
    if action == "idle":
        kind, use_graph, finite = got
        assert kind == "idle" and finite, where
        return
    if want is None:  # the step where replica 1 reports a wrong count: every rank raised
        assert got[0] == "error", where
        kind, culprit, reported, agreed, message = got
        assert (culprit, reported, agreed) == (1, 2, 1), where  # one decode row, reported 2
        assert "replica 1 (global rank 2) sent 1 tokens to the DP agreement" in message, message
        assert "its batch dispatches 2 tokens" in message and "step 5 (TARGET), layer 0" in message
        return
    if action == "draft":
        kind, sampled, proposals = got
        assert kind == "draft" and (sampled, proposals) == want, where
        assert [len(p) for p in proposals.values()] == [K]
        return
    kind, use_graph, tokens, logits = got
    assert kind == "ok" and use_graph == (action == "graph"), where
    np.testing.assert_allclose(logits, want[1], atol=2e-4, rtol=1e-4, err_msg=where)
    assert tokens.tolist() == want[0].tolist(), where
