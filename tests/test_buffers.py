"""Persistent buffers: fixed storage, in-place writes that move versions, safe dummies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.config import ParallelLayout, RunnerConfig
from runner_fsm.errors import BatchError
from runner_fsm.pcp.buffers import (
    BUFFER_NAMES,
    BufferFingerprint,
    PersistentBuffers,
    dummy_query_lens,
    stale_buffers,
)
from runner_fsm.pcp.context import build_real_context
from runner_fsm.pcp.plan import plan_batch

WORKED_TABLES = np.array([[5, 6, 7], [2, 3, -1]])
WORKED_IDS = np.arange(100, 111)


def make_buffers(pcp_size=2, max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8):
    config = RunnerConfig(
        layout=ParallelLayout(pcp_size=pcp_size),
        max_num_tokens=max_num_tokens,
        max_num_reqs=max_num_reqs,
        max_blocks_per_req=max_blocks_per_req,
        capture_sizes=(1,),
    )
    return PersistentBuffers(config)


def worked_write(buffers, rank):
    plan = plan_batch([1, 10], [0, 1], [37, 0], 2)
    ctx = build_real_context(plan, rank, WORKED_TABLES, 16)
    buffers.write_real(plan, rank, WORKED_IDS, WORKED_TABLES, ctx.gathered_slot_mapping)
    return plan


def snapshot(buffers):
    return {name: getattr(buffers, name).clone() for name in BUFFER_NAMES}


def test_allocation_at_capacity():
    buf = make_buffers(pcp_size=2, max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8)
    shapes = {name: bp.shape for name, bp in buf.fingerprint().items()}
    assert shapes == {
        "input_ids": (16,),
        "positions": (16,),
        "is_padding": (16,),
        "query_start_loc": (9,),
        "seq_lens": (8,),
        "block_tables": (8, 8),
        "gathered_slot_mapping": (32,),
        "is_replicated": (16,),
    }
    assert buf.is_padding.dtype == torch.bool and buf.is_padding.all()
    assert (buf.gathered_slot_mapping == -1).all()
    assert buf.input_ids.device.type == "cpu"
    assert (buf.num_tokens, buf.num_segments) == (0, 0)


def test_write_real_worked_example_rank1():
    buf = make_buffers()
    worked_write(buf, 1)
    assert buf.input_ids[:8].tolist() == [100, 104, 105, 106, 107, 108, 109, 0]
    assert buf.positions[:8].tolist() == [37, 3, 4, 5, 6, 7, 8, 0]
    assert buf.is_padding.tolist() == [False] * 7 + [True] * 9
    assert buf.query_start_loc.tolist() == [0, 1, 4, 7] + [7] * 5
    assert buf.seq_lens.tolist() == [38, 6, 9] + [0] * 5
    assert buf.block_tables[:3, :3].tolist() == [[5, 6, 7], [2, 3, -1], [2, 3, -1]]
    assert not buf.block_tables[3:].any() and not buf.block_tables[:, 3:].any()
    assert buf.gathered_slot_mapping.tolist() == (
        [117, 41, 32, 33, 34, -1, -1, -1, 35, 36, 37, 38, 39, 40] + [-1] * 18
    )
    assert (buf.num_tokens, buf.num_segments, buf.is_dummy) == (7, 3, False)


def test_write_real_pads_short_rank():
    buf = make_buffers()
    worked_write(buf, 0)  # rank 0 has 5 rows of N = 7
    assert buf.input_ids[:7].tolist() == [100, 110, 101, 102, 103, 0, 0]
    assert buf.positions[:7].tolist() == [37, 9, 0, 1, 2, 0, 0]
    assert buf.is_padding[:7].tolist() == [False] * 5 + [True] * 2


def test_dummy_after_real_keeps_storage_and_clears_everything():
    buf = make_buffers()
    worked_write(buf, 1)
    before = buf.fingerprint()
    buf.write_dummy(num_reqs=3, num_tokens=7)
    after = buf.fingerprint()
    for name in BUFFER_NAMES:
        assert after[name].ptr == before[name].ptr, f"{name} moved"
        assert after[name].shape == before[name].shape
        assert after[name].version > before[name].version, f"{name} was not rewritten"
    assert stale_buffers(before, after) == ()
    assert not buf.block_tables.any()
    assert (buf.gathered_slot_mapping == -1).all()
    assert not buf.input_ids.any() and not buf.positions.any() and buf.is_padding.all()
    assert buf.query_start_loc.tolist() == [0, 2, 4, 7] + [7] * 5
    assert buf.seq_lens.tolist() == [2, 2, 3] + [0] * 5
    assert (buf.num_tokens, buf.num_segments, buf.is_dummy) == (7, 3, True)


def test_real_after_dummy_restores_real_values():
    buf = make_buffers()
    worked_write(buf, 1)
    real = snapshot(buf)
    buf.write_dummy(num_reqs=1, num_tokens=16)
    ptrs = {name: fp.ptr for name, fp in buf.fingerprint().items()}
    worked_write(buf, 1)
    for name, tensor in real.items():
        assert torch.equal(getattr(buf, name), tensor), name
    assert {name: fp.ptr for name, fp in buf.fingerprint().items()} == ptrs


def test_stale_buffers_names_untouched_ones():
    buf = make_buffers()
    fp = buf.fingerprint()
    assert stale_buffers(fp, buf.fingerprint()) == BUFFER_NAMES
    buf.block_tables[0, 0] = 1  # a view write moves the base's version
    untouched = tuple(n for n in BUFFER_NAMES if n != "block_tables")
    assert stale_buffers(fp, buf.fingerprint()) == untouched
    assert isinstance(fp["input_ids"], BufferFingerprint)


def test_dummy_query_lens():
    assert dummy_query_lens(3, 7).tolist() == [2, 2, 3]
    assert dummy_query_lens(1, 5).tolist() == [5]
    assert dummy_query_lens(0, 0).tolist() == []
    with pytest.raises(BatchError, match="a dummy of 4 tokens needs 1..4 requests, got 5"):
        dummy_query_lens(5, 4)
    with pytest.raises(BatchError, match="a dummy of 0 tokens has 0 requests, got num_reqs=1"):
        dummy_query_lens(1, 0)


# -- capacity and shape errors, raised before any write ------------------------------------


def _plan_and_args(**overrides):
    plan = plan_batch([1, 10], [0, 1], [37, 0], 2)
    ctx = build_real_context(plan, 1, WORKED_TABLES, 16)
    args = dict(
        plan=plan, rank=1, input_ids_global=WORKED_IDS, block_tables=WORKED_TABLES,
        gathered_slots=ctx.gathered_slot_mapping,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "buffers_kw, overrides, match",
    [
        (dict(max_num_tokens=6), {}, r"plan rank 1 needs 7 rank-local rows.*max_num_tokens=6"),
        (dict(max_num_reqs=1), {}, r"plan rank 1 needs 3 segments.*num_segments=2"),
        (dict(pcp_size=4), {}, r"plan is for pcp_size=2, buffers for 4"),
        (dict(max_blocks_per_req=2), {}, r"block_tables rows have 3 blocks.*max_blocks_per_req=2"),
        ({}, dict(rank=2), r"rank must lie in \[0, 2\), got 2"),
        ({}, dict(input_ids_global=np.arange(5)), r"input_ids_global has 5 entries.*11 global"),
        ({}, dict(gathered_slots=np.zeros(7, np.int64)), r"gathered_slots has 7 .*P\*N=14"),
        ({}, dict(block_tables=WORKED_TABLES[:1]), r"request 1 has no block-table row"),
        ({}, dict(block_tables=WORKED_TABLES * 2**31), r"block_tables holds .*int32"),
    ],
)
def test_write_real_rejects_before_writing(buffers_kw, overrides, match):
    buf = make_buffers(**buffers_kw)
    before = buf.fingerprint()
    with pytest.raises(BatchError, match=match):
        buf.write_real(**_plan_and_args(**overrides))
    assert buf.fingerprint() == before, "a rejected batch must not touch the buffers"


@pytest.mark.parametrize(
    "num_reqs, num_tokens, match",
    [
        (1, 17, r"dummy needs 17 rank-local rows, capacity is max_num_tokens=16"),
        (9, 16, r"dummy needs 9 segments, capacity is num_segments=8"),
        (5, 4, r"a dummy of 4 tokens needs 1..4 requests, got 5"),
        (1, -1, r"dummy needs -1 rank-local rows"),
        (1, 2.0, r"dummy: num_tokens must be an integer, got 2.0"),
    ],
)
def test_write_dummy_rejects_before_writing(num_reqs, num_tokens, match):
    buf = make_buffers()
    worked_write(buf, 0)
    before = buf.fingerprint()
    with pytest.raises(BatchError, match=match):
        buf.write_dummy(num_reqs, num_tokens)
    assert buf.fingerprint() == before
    assert not buf.is_dummy


# -- property: every rank's rows are the plan's rows ---------------------------------------


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 4))
    prefilling = draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs))
    scheduled = [draw(st.integers(1, 24) if p else st.integers(1, 3)) for p in prefilling]
    computed = [draw(st.integers(0, 30)) for _ in range(num_reqs)]
    return scheduled, prefilling, computed


@settings(max_examples=80, deadline=None)
@given(batch=batches(), pcp_size=st.integers(1, 8), chunking=st.sampled_from(["ceil", "balanced"]))
def test_write_real_matches_plan(batch, pcp_size, chunking):
    scheduled, prefilling, computed = batch
    plan = plan_batch(scheduled, prefilling, computed, pcp_size, chunking=chunking)
    tables = np.arange(len(scheduled) * 16).reshape(len(scheduled), 16)
    ids = np.arange(plan.num_tokens) * 7 + 1
    buf = make_buffers(pcp_size=pcp_size, max_num_tokens=128, max_blocks_per_req=16)
    for rank, rb in enumerate(plan.ranks):
        ctx = build_real_context(plan, rank, tables, 4)
        before = buf.fingerprint()
        buf.write_real(plan, rank, ids, tables, ctx.gathered_slot_mapping)
        assert stale_buffers(before, buf.fingerprint()) == ()
        n, s = rb.num_tokens, rb.num_segments
        assert buf.input_ids[:n].tolist() == ids[rb.token_idx].tolist()
        assert buf.positions[:n].tolist() == rb.positions.tolist()
        assert int((~buf.is_padding).sum()) == n
        assert buf.query_start_loc[: s + 1].tolist() == rb.query_start_loc.tolist()
        assert buf.seq_lens[:s].tolist() == rb.seq_lens.tolist()
        assert buf.block_tables[:s].tolist() == tables[rb.seg_req_idx].tolist()
        gathered = buf.gathered_slot_mapping[: pcp_size * plan.num_tokens_padded]
        assert gathered.tolist() == ctx.gathered_slot_mapping.tolist()
        assert buf.num_tokens == plan.num_tokens_padded
