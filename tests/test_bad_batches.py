"""Bad scheduled batches: a `BatchError` before any state changes, and an abort to the peers.

A replica with the real model has served one request for a step; then each malformed batch
must be refused with request state, KV cache and persistent buffers byte-identical before
and after, and the replica must join that step's agreement with an abort status.
"""

import dataclasses

import numpy as np
import pytest
import torch

from runner_fsm import dp
from runner_fsm.batch import ScheduledBatch
from runner_fsm.config import ParallelLayout, RunnerConfig
from runner_fsm.errors import BatchError
from runner_fsm.events import Capture, RealStep
from runner_fsm.model import TARGET_SPEC, load_model, make_random_model
from runner_fsm.states import State
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer
from runner_fsm.testing.harness import make_runner

pytestmark = pytest.mark.asyncio

NUM_BLOCKS = 32
CONFIG = RunnerConfig(layout=ParallelLayout(dp_size=2), max_num_tokens=64, max_num_reqs=4,
                      max_blocks_per_req=8, num_speculative_tokens=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad-batches") / "model"
    make_random_model(path, TARGET_SPEC, seed=5)
    return path


def _good() -> ScheduledBatch:
    """Request 'a' decodes (it prefilled 9 tokens in the first step); 'b' is new."""
    return ScheduledBatch.build(["a", "b"], [1, 6], [False, True], [9, 0], [11, 3, 4, 5, 6, 7, 8],
                                [[0, -1], [1, 2]], num_draft_tokens=[0, 0])


def _with(**changes) -> ScheduledBatch:
    good = _good()
    return dataclasses.replace(good, **{k: np.asarray(v) if isinstance(v, list) else v
                                        for k, v in changes.items()})


BAD = {
    "negative count": (_with(num_scheduled=[1, -6]), "num_scheduled must be >= 0"),
    "unknown request id": (_with(req_ids=("zz", "b")), "unknown request id 'zz' claims 9 computed tokens"),
    "block out of range": (_with(block_tables=np.array([[0, -1], [NUM_BLOCKS, 2]])),
                           f"uses block id {NUM_BLOCKS} .* outside \\[0, {NUM_BLOCKS}\\)"),
    "draft tokens on a prefill": (_with(num_draft_tokens=[0, 2]), "'b' is prefilling but carries 2 draft tokens"),
    "more tokens than the buffers hold": (
        ScheduledBatch.build(["c"], [65], [True], [0], list(range(65)), [list(range(5))]),
        "schedules 65 tokens, more than max_num_tokens=64"),
    "mismatched lengths": (_with(num_computed=[9]), "num_computed must have one entry per request"),
    "token count mismatch": (_with(token_ids=np.arange(5)), "token_ids must hold 7 ids"),
}


async def _served_runner(model_dir):
    peers = ScriptedPeers(busy_peer(3))
    model = load_model(model_dir, kv_num_blocks=NUM_BLOCKS, block_size=CONFIG.block_size)
    runner = make_runner(CONFIG, peers, model=model)
    await runner.handle(Capture())
    first = ScheduledBatch.build(["a"], [9], [True], [0], list(range(20, 29)), [[0]])
    await runner.handle(RealStep(first))
    return runner, peers


def _state(runner):
    replica = runner.replica
    cache = replica.model.cache
    return (replica.requests.snapshot(), cache.k.clone(), cache.v.clone(),
            {name: getattr(replica.buffers, name).clone() for name in replica.buffers.fingerprint()},
            replica.buffers.fingerprint())


@pytest.mark.parametrize("name", list(BAD))
async def test_bad_batch_is_refused_before_any_change(model_dir, name):
    batch, message = BAD[name]
    runner, peers = await _served_runner(model_dir)
    before = _state(runner)
    with pytest.raises(BatchError, match=message):
        await runner.handle(RealStep(batch))
    after = _state(runner)
    assert after[0] == before[0], "request state changed"
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2]), "KV cache changed"
    for buf in before[3]:
        assert torch.equal(after[3][buf], before[3][buf]), f"buffer {buf} changed"
    assert after[4] == before[4], "a buffer was written (its version moved)"
    assert runner.replica.machine.state is State.FAULTED
    # the peers learn it in the step's agreement: an abort status from this replica
    assert peers.sent[-1].status == dp.STATUS_BATCH_ERROR
    assert peers.sent[-1].step_id == runner.replica.step_id == 1


async def test_the_good_batch_passes(model_dir):
    runner, _ = await _served_runner(model_dir)
    out = await runner.handle(RealStep(_good()))
    assert set(out.sampled) == {"a", "b"}
