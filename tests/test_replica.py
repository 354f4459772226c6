"""One replica with fakes for the model: real -> idle -> real hand-offs, faults, drafting."""

import time

import numpy as np
import pytest
import torch

from runner_fsm import dp
from runner_fsm.audit import read_records
from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.errors import BatchError, CollectiveTimeout, StaleBufferError
from runner_fsm.events import Capture, DummyStep, RealStep, Shutdown
from runner_fsm.states import State
from runner_fsm.dp import SingleReplicaAgreement
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer, expected_tokens
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch

pytestmark = pytest.mark.asyncio

TWO_REPLICAS = ParallelLayout(dp_size=2)


def _config(**kw):
    base = dict(layout=TWO_REPLICAS, max_num_tokens=64, max_num_reqs=8, capture_sizes=(1, 2, 4, 8))
    base.update(kw)
    return RunnerConfig(**base)


class Poison:
    """A saved state that fails the test if anything reads it."""

    def __getattr__(self, name):
        raise AssertionError(f"dummy step read saved real state ({name})")


def _records(run_dir, rank=0):
    return list(read_records(run_dir / f"rank-{rank}.jsonl"))


async def test_real_idle_real_in_eager_mode(tmp_path):
    cfg = _config()
    runner = make_runner(cfg, ScriptedPeers(busy_peer(5)), run_dir=tmp_path)
    replica = runner.replica
    await runner.handle(Capture())
    first = prefill_batch([7, 3])
    out = await runner.handle(RealStep(first))
    assert out.sampled == expected_tokens(first)

    ptrs = {k: v.ptr for k, v in replica.buffers.fingerprint().items()}
    replica.contexts.last_real = Poison()
    idle = await runner.handle(DummyStep())
    assert idle.num_rows == 1 and not idle.agreed.all_idle
    assert replica.model.last_input_ids.tolist() == [0]  # the dummy's row, not the real batch's
    assert {k: v.ptr for k, v in replica.buffers.fingerprint().items()} == ptrs
    assert (replica.buffers.block_tables == 0).all()
    assert (replica.buffers.gathered_slot_mapping == -1).all()

    second = decode_batch([7, 3], seed=5)
    out = await runner.handle(RealStep(second))
    assert out.sampled == expected_tokens(second)
    assert replica.machine.state is State.READY


async def test_dummy_context_same_with_and_without_stale_state(tmp_path):
    cfg = _config()
    runs = []
    for poison in (False, True):
        runner = make_runner(cfg, ScriptedPeers(busy_peer(3)))
        await runner.handle(Capture())
        await runner.handle(RealStep(prefill_batch([9])))
        if poison:
            runner.replica.contexts.last_real = Poison()
        else:
            runner.replica.contexts.last_real = None
        await runner.handle(DummyStep())
        runs.append({k: getattr(runner.replica.buffers, k).clone() for k in
                     ("input_ids", "positions", "block_tables", "gathered_slot_mapping", "seq_lens")})
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


async def test_graph_replay_after_dummy_refresh_and_stale_refresh_refused(tmp_path):
    cfg = _config(graph_mode=GraphMode.FULL_DECODE_ONLY)
    peers = ScriptedPeers(busy_peer(3, dp.GRAPH_FULL, 1), capture_sizes=cfg.capture_sizes)
    runner = make_runner(cfg, peers, run_dir=tmp_path)
    replica = runner.replica
    await runner.handle(Capture())
    decode = decode_batch([20, 30], cached_prefix=True)
    out = await runner.handle(RealStep(decode))
    assert out.graph and out.num_rows == 4  # padded to the peer's 3, then to capture size 4
    assert out.sampled == expected_tokens(decode)

    idle = await runner.handle(DummyStep())
    assert idle.graph and idle.num_rows == 4
    assert replica.model.last_input_ids.tolist() == [0, 0, 0, 0]

    replica.buffers.write_dummy = lambda num_reqs, num_tokens: None  # a skipped refresh
    with pytest.raises(StaleBufferError, match="were not refreshed this step"):
        await runner.handle(DummyStep())
    assert replica.machine.state is State.FAULTED
    faults = [r for r in _records(tmp_path) if r["event"] == "fault"]
    assert faults and faults[-1]["error"] == "StaleBufferError"
    replays = [r for r in _records(tmp_path) if r["event"] == "graph" and r["action"] == "replay"]
    assert [r["step_id"] for r in replays] == [0, 1]


async def test_replay_refused_when_storage_moved():
    cfg = _config(graph_mode=GraphMode.FULL_DECODE_ONLY)
    runner = make_runner(cfg, ScriptedPeers(busy_peer(1, dp.GRAPH_FULL, 1), cfg.capture_sizes))
    await runner.handle(Capture())
    runner.replica.buffers.input_ids = torch.zeros_like(runner.replica.buffers.input_ids)
    with pytest.raises(StaleBufferError, match="storage of input_ids .* differs from capture"):
        await runner.handle(RealStep(decode_batch([4], cached_prefix=True)))


@pytest.mark.parametrize("k, per_step", [(1, [dp.DRAFT_PREFILL]), (3, [dp.DRAFT_PREFILL, dp.DRAFT_DECODE])])
async def test_every_step_kind_issues_the_same_draft_agreements(k, per_step):
    cfg = _config(num_speculative_tokens=k)
    peers = ScriptedPeers(busy_peer(2))
    runner = make_runner(cfg, peers)
    await runner.handle(Capture())
    steps = [RealStep(prefill_batch([6])), DummyStep(), RealStep(decode_batch([6], num_draft_tokens=[k]))]
    expected_rows = []
    for event in steps:
        before = len(peers.sent)
        out = await runner.handle(event)
        phases = [s.phase for s in peers.sent[before:]]
        assert phases == [dp.TARGET, *per_step], type(event).__name__
        assert {s.step_id for s in peers.sent[before:]} == {out.step_id}
        expected_rows.append(sum(len(t) + 1 for t in out.sampled.values()))
        if isinstance(event, RealStep):
            assert set(out.drafts) == set(event.batch.req_ids)
            assert all(len(d) == k for d in out.drafts.values())
    draft_prefill = [s for s in peers.sent if s.phase == dp.DRAFT_PREFILL]
    # the draft runs the global batch: counts are global, an idle replica sends 0
    assert [s.num_tokens for s in draft_prefill] == expected_rows
    assert expected_rows[1] == 0 and expected_rows[0] == 2


async def test_bad_batch_changes_nothing_and_aborts_peers(tmp_path):
    cfg = _config()
    peers = ScriptedPeers(busy_peer(2))
    runner = make_runner(cfg, peers, run_dir=tmp_path)
    await runner.handle(Capture())
    before = runner.replica.buffers.fingerprint()
    bad = prefill_batch([4])
    object.__setattr__(bad, "num_scheduled", np.array([-4]))
    with pytest.raises(BatchError, match="replica 0, step 0: num_scheduled must be >= 0"):
        await runner.handle(RealStep(bad))
    assert runner.replica.buffers.fingerprint() == before
    assert runner.replica.machine.state is State.FAULTED
    assert peers.sent[-1].status == dp.STATUS_BATCH_ERROR and peers.sent[-1].step_id == 0
    with pytest.raises(Exception, match="refuses RealStep: faulted at step 0"):
        await runner.handle(RealStep(prefill_batch([4])))


async def test_exception_in_forward_faults_with_cause_logged(tmp_path):
    class Broken:
        def forward(self, *a):
            raise RuntimeError("expert weights missing")

    runner = make_runner(_config(layout=ParallelLayout()), SingleReplicaAgreement(), run_dir=tmp_path, model=Broken())
    await runner.handle(Capture())
    with pytest.raises(RuntimeError, match="expert weights missing"):
        await runner.handle(RealStep(prefill_batch([3])))
    assert runner.replica.machine.state is State.FAULTED
    records = _records(tmp_path)
    assert records[-2]["event"] == "fault" and "expert weights missing" in records[-2]["message"]
    assert (records[-1]["trigger"], records[-1]["dst"]) == ("fault", "faulted")


async def test_collective_timeout_faults_and_leaves_dangling_enqueue(tmp_path):
    class Stuck:
        def sync(self, local):
            time.sleep(3)  # a peer that never joins

    cfg = _config(layout=ParallelLayout(), collective_timeout_s=0.2)
    runner = make_runner(cfg, Stuck(), run_dir=tmp_path)
    await runner.handle(Capture())
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="all_reduce on group 'dp' .* at step 0 did not finish within 0.2 s"):
        await runner.handle(RealStep(prefill_batch([3])))
    assert time.monotonic() - start < 2
    assert runner.replica.machine.state is State.FAULTED
    collectives = [r for r in _records(tmp_path) if r["event"] == "collective"]
    assert collectives[-1]["stage"] == "enqueue"


async def test_shutdown_refuses_later_events_and_closes_log(tmp_path):
    closed = []
    runner = make_runner(_config(layout=ParallelLayout()), SingleReplicaAgreement(), run_dir=tmp_path,
                         on_close=lambda: closed.append(True))
    await runner.handle(Capture())
    await runner.handle(Shutdown("test over"))
    with pytest.raises(Exception, match="stopped: test over"):
        await runner.handle(DummyStep())
    await runner.close()
    assert closed == [True] and runner.replica.audit.closed


async def test_serve_answers_every_event_in_order_and_refuses_after_a_fault():
    import anyio

    from runner_fsm.replica.driver import EventRefused

    class Broken:
        def forward(self, *a):
            raise RuntimeError("boom")

    runner = make_runner(_config(layout=ParallelLayout()), SingleReplicaAgreement(), model=Broken())
    send_events, events = anyio.create_memory_object_stream(8)
    send_outcomes, outcomes = anyio.create_memory_object_stream(8)
    script = [Capture(), RealStep(prefill_batch([3])), DummyStep(), Shutdown("late")]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(runner.serve, events, send_outcomes)
        async with send_events:
            for event in script:
                await send_events.send(event)
        answers = [o async for o in outcomes]
    assert [a.event for a in answers] == script
    assert answers[0].ok
    assert isinstance(answers[1].error, RuntimeError) and "boom" in str(answers[1].error)
    for refused in answers[2:]:
        assert isinstance(refused.error, EventRefused)
        assert "faulted at step 0: boom" in str(refused.error)
    assert runner.replica.machine.state is State.FAULTED
