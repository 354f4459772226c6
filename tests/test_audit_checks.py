"""The rules of `runner_fsm.rules.checks`, each written once and used online and offline.

The runner must refuse what replay would call unsound, with the same rule: a refresh that
only rewrites the same bytes (`buf.copy_(buf)`) is stale on both sides, in eager and in graph
mode; the dispatch count recomputed from the logged inputs is the planner's own.
"""

import numpy as np
import pytest

from runner_fsm import dp
from runner_fsm.rules.checks import (divergent_outputs, output_digest, own_agreement_problem,
                                     recomputed_dispatch_count, stale_inputs)
from runner_fsm.rules.checks import dispatch_inputs
from runner_fsm.rules.context_rule import context_evidence_missing, context_problem
from runner_fsm.replay.judge import replay
from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.errors import StaleBufferError
from runner_fsm.events import Capture, DummyStep, RealStep
from runner_fsm.replica.evidence import identity
from runner_fsm.pcp.buffers import BufferFingerprint
from runner_fsm.pcp.plan import num_tokens_for_dispatch
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch


def _fp(version, digest):
    return BufferFingerprint(0x1000, (8,), version, digest)


def test_stale_inputs_unwritten_buffer_and_dummy_on_the_bytes_of_the_last_real_batch():
    since = {"a": _fp(3, 11), "b": _fp(5, 22)}
    last_real = {"a": _fp(3, 11), "b": _fp(5, 22)}
    assert "['b'] were not refreshed" in stale_inputs({"a": _fp(4, 33), "b": _fp(5, 22)}, since, last_real)
    # Every counter moved, every byte is the last real batch's: a copy onto itself.
    copied = {"a": _fp(4, 11), "b": _fp(6, 22)}
    assert "content digests unchanged" in stale_inputs(copied, since, last_real)
    assert stale_inputs({"a": _fp(4, 11), "b": _fp(6, 99)}, since, last_real) is None  # one buffer changed
    assert stale_inputs({"a": _fp(4, None), "b": _fp(6, None)}, since, last_real) is None  # no digest: no claim
    assert stale_inputs(copied, since, None) is None  # a real batch may repeat the last one


def test_context_must_be_built_for_the_forward_s_own_batch():
    dummy_batch = identity(7, True, 2, 0xAB)
    assert context_problem(7, dummy_batch, identity(7, True, 2, 0xAB)) is None
    assert "used a real batch's PCP context built at step 5" in context_problem(7, dummy_batch, identity(5, False, 2, 0xCD))
    assert "for 4 rows" in context_problem(7, dummy_batch, identity(7, True, 4, 0xAB))
    # same step, rows and kind, but arrays that are not the dummy's: the digest tells
    assert "its arrays are not the step's dummy's: digests differ" in \
        context_problem(7, dummy_batch, identity(7, True, 2, 0xCD))


def test_context_evidence_missing_is_named_not_read_as_sound():
    whole = identity(7, True, 2, 0xAB)
    assert context_evidence_missing(whole, whole) is None
    assert context_evidence_missing(whole, None) == "no `ctx` identity"
    assert context_evidence_missing(None, whole) == "no `batch` identity"
    old = {"step": 7, "dummy": True, "rows": 2}  # a writer from before the digest
    assert context_evidence_missing(whole, old) == "its `ctx` identity lacks digest"


def test_context_digest_is_the_plan_s_and_differs_from_a_dummy_s():
    from runner_fsm.replica.evidence import context_identity
    from runner_fsm.pcp.context import build_dummy_context, build_real_context, dummy_digest, plan_digest
    from runner_fsm.pcp.plan import plan_batch

    plan = plan_batch([1, 10], [False, True], [37, 0], 2)
    tables = np.arange(8).reshape(2, 4)
    for rank in range(2):
        real = build_real_context(plan, rank, tables, 16, step_id=3)
        dummy = build_dummy_context(plan.num_tokens_padded, 2, rank, step_id=4)
        assert context_identity(real) == identity(3, False, plan.num_tokens_padded, plan_digest(plan))
        assert context_identity(dummy) == identity(4, True, plan.num_tokens_padded,
                                                   dummy_digest(plan.num_tokens_padded, 2, rank))
        # the real context reused for the dummy of step 4 (the hand-off bug), and a context
        # stamped for the right step but holding the real plan's arrays: both refused
        dummy_batch = identity(4, True, plan.num_tokens_padded, dummy_digest(plan.num_tokens_padded, 2, rank))
        assert "built at step 3" in context_problem(4, dummy_batch, context_identity(real))
        forged = dict(context_identity(real), step=4, dummy=True)
        assert "digests differ" in context_problem(4, dummy_batch, forged)


def test_own_agreement_rule_eager_exact_graph_at_least():
    assert own_agreement_problem(3, dp.TARGET, 5, 3, dp.TARGET, 5, dp.GRAPH_EAGER) is None
    assert "exactly" in own_agreement_problem(3, dp.TARGET, 5, 3, dp.TARGET, 6, dp.GRAPH_EAGER)
    assert own_agreement_problem(3, dp.TARGET, 5, 3, dp.TARGET, 8, dp.GRAPH_FULL) is None
    assert "at least" in own_agreement_problem(3, dp.TARGET, 5, 3, dp.TARGET, 4, dp.GRAPH_FULL)
    assert "agreed on step 2" in own_agreement_problem(3, dp.TARGET, 5, 2, dp.TARGET, 5, dp.GRAPH_EAGER)


@pytest.mark.parametrize("chunking", ["ceil", "balanced"])
def test_dispatch_count_recomputed_from_compact_inputs_is_the_planner_s(chunking):
    rng = np.random.default_rng(7)
    for _ in range(300):
        reqs = int(rng.integers(1, 12))
        scheduled = rng.integers(1, 300, reqs)
        prefilling = rng.random(reqs) < 0.4
        scheduled[~prefilling] = rng.integers(1, 4, int((~prefilling).sum()))  # decode / verify rows
        pcp = int(rng.integers(1, 9))
        inputs = dispatch_inputs(scheduled, prefilling, pcp, chunking)
        assert recomputed_dispatch_count(inputs) == num_tokens_for_dispatch(scheduled, prefilling, pcp,
                                                                              chunking=chunking)


def test_output_digest_tells_tokens_and_order_apart():
    a = output_digest({"r0": [5, 6], "r1": [7]})
    assert a == output_digest({"r0": [5, 6], "r1": [7]}) and a[1] == 3
    assert a != output_digest({"r0": [5, 7], "r1": [7]})
    assert a != output_digest({"r0": [6, 5], "r1": [7]})
    assert divergent_outputs({0: 1, 1: 1}) is None and divergent_outputs({0: 1, 1: 2}) == {0: 1, 1: 2}


def _copy_onto_itself(buffers):
    """A refresh that moves every write counter and changes no byte."""
    def write_dummy(num_reqs, num_tokens):
        for tensor in buffers._buffers():
            tensor.copy_(tensor.clone())
    return write_dummy


@pytest.mark.asyncio
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
async def test_copy_onto_itself_is_refused_online_and_named_offline(tmp_path, graphs):
    mode = GraphMode.FULL_DECODE_ONLY if graphs else GraphMode.NONE
    cfg = RunnerConfig(layout=ParallelLayout(dp_size=2), max_num_tokens=64, max_num_reqs=8,
                       capture_sizes=(1, 2, 4, 8), graph_mode=mode)
    peer = busy_peer(3, dp.GRAPH_FULL, 1) if graphs else busy_peer(3)
    runner = make_runner(cfg, ScriptedPeers(peer, capture_sizes=cfg.capture_sizes), run_dir=tmp_path)
    replica = runner.replica
    await runner.handle(Capture())
    if graphs:
        await runner.handle(RealStep(decode_batch([20, 30], cached_prefix=True)))  # a graph replay
    else:
        await runner.handle(RealStep(prefill_batch([5, 7])))
    replica.buffers.write_dummy = _copy_onto_itself(replica.buffers)
    with pytest.raises(StaleBufferError, match="content digests unchanged"):
        await runner.handle(DummyStep())
    report = replay(tmp_path)
    named = [v for v in report.verdicts if v.kind == "stale_buffer_replay" and (v.replica, v.step) == (0, 1)]
    assert named and "content digests unchanged" in named[0].detail, report.format()
