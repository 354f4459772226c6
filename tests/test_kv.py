"""KV placement (DESIGN.md section 4): hand-worked slots, errors, and the write-once rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.errors import BatchError
from runner_fsm.pcp.context import global_token_layout
from runner_fsm.pcp.kv import PAD_SLOT_ID, dummy_slot_mapping, gathered_slot_mapping, slot_mapping
from runner_fsm.pcp.plan import plan_batch

# -- hand-worked examples ------------------------------------------------------------------


def test_pad_slot_id_is_minus_one():
    assert PAD_SLOT_ID == -1


def test_dcp1_slots_follow_the_block_table():
    # bs=4, blocks [3, 7]: positions 0 and 3 in block 3, positions 4 and 6 in block 7.
    slots = slot_mapping([0, 3, 4, 6], [0, 0, 0, 0], np.array([[3, 7]]), 4)
    assert slots.tolist() == [12, 15, 28, 30]
    assert slots.dtype == np.int64


def test_dcp1_two_requests_use_their_own_rows():
    tables = np.array([[3, 7], [1, 9]])
    slots = slot_mapping([5, 5, 0], [0, 1, 1], tables, 4)
    assert slots.tolist() == [29, 37, 4]


def test_dcp2_interleave1_alternates_owners():
    # bs=2, D=2: span 4. Even offsets on rank 0, odd on rank 1; each rank fills its block.
    tables = np.array([[10, 20]])
    pos = np.arange(8)
    req = np.zeros(8, dtype=np.int64)
    r0 = slot_mapping(pos, req, tables, 2, dcp_size=2, dcp_rank=0)
    r1 = slot_mapping(pos, req, tables, 2, dcp_size=2, dcp_rank=1)
    assert r0.tolist() == [20, -1, 21, -1, 40, -1, 41, -1]
    assert r1.tolist() == [-1, 20, -1, 21, -1, 40, -1, 41]


def test_dcp2_interleave2_owns_runs_of_two():
    # bs=4, D=2, I=2: span 8; offsets 0-1 and 4-5 on rank 0, 2-3 and 6-7 on rank 1.
    tables = np.array([[1, 2]])
    pos = np.arange(16)
    req = np.zeros(16, dtype=np.int64)
    r0 = slot_mapping(pos, req, tables, 4, dcp_size=2, dcp_rank=0, interleave=2)
    r1 = slot_mapping(pos, req, tables, 4, dcp_size=2, dcp_rank=1, interleave=2)
    assert r0.tolist() == [4, 5, -1, -1, 6, 7, -1, -1, 8, 9, -1, -1, 10, 11, -1, -1]
    assert r1.tolist() == [-1, -1, 4, 5, -1, -1, 6, 7, -1, -1, 8, 9, -1, -1, 10, 11]


def test_interleave_is_ignored_without_dcp():
    tables = np.array([[3, 7]])
    a = slot_mapping([0, 5], [0, 0], tables, 4, interleave=2)
    assert a.tolist() == [12, 29]


def test_empty_batch_gives_empty_slots():
    out = slot_mapping(np.zeros(0, dtype=np.int64), [], np.zeros((0, 0), dtype=np.int64), 4)
    assert out.shape == (0,) and out.dtype == np.int64


# -- errors name the request ---------------------------------------------------------------


@pytest.mark.parametrize(
    "positions, req_idx, table, match",
    [
        ([0, -3], [0, 1], [[1, 2], [3, 4]], r"request 1: token 1 has negative position -3"),
        ([0, 1], [0, 2], [[1, 2], [3, 4]], r"request 2 .*no block-table row.*2 rows"),
        ([0, 1], [-1, 0], [[1, 2], [3, 4]], r"request -1 "),
        ([0, 9], [1, 1], [[1, 2], [3, 4]], r"request 1, position 9: needs block 2.*2 blocks"),
        ([0, 4], [0, 1], [[1, 2], [3, -1]], r"request 1, position 4: block 1 .*block id -1"),
    ],
)
def test_bad_tokens_raise_naming_the_request(positions, req_idx, table, match):
    with pytest.raises(BatchError, match=match):
        slot_mapping(positions, req_idx, np.array(table), 4)


def test_unused_negative_block_is_fine():
    # Unallocated tail entries of a table are allowed as long as no token lands in them.
    assert slot_mapping([1], [0], np.array([[2, -1]]), 4).tolist() == [9]


def test_negative_block_rejected_on_non_owner_rank_too():
    # Every DCP rank must reject the same batch, not only the owner of the token.
    with pytest.raises(BatchError, match="request 0, position 1: block 0"):
        slot_mapping([1], [0], np.array([[-1]]), 2, dcp_size=2, dcp_rank=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), r"block_size must be an integer >= 1, got 0"),
        (dict(block_size=4, dcp_size=2, dcp_rank=2), r"dcp_rank must lie in \[0, 2\), got 2"),
        (dict(block_size=4, dcp_rank=-1), r"dcp_rank must lie in \[0, 1\), got -1"),
        (dict(block_size=4, interleave=0), r"interleave must be an integer >= 1, got 0"),
        (dict(block_size=4, dcp_size=2, interleave=3), r"interleave=3 must divide block_size=4"),
        (dict(block_size=4, dcp_size=0), r"dcp_size must be an integer >= 1"),
    ],
)
def test_bad_layout_raises(kwargs, match):
    block_size = kwargs.pop("block_size")
    with pytest.raises(BatchError, match=match):
        slot_mapping([0], [0], np.array([[1]]), block_size, **kwargs)


def test_shape_errors():
    with pytest.raises(BatchError, match="one entry per token.*2 and 1"):
        slot_mapping([0, 1], [0], np.array([[1]]), 4)
    with pytest.raises(BatchError, match="block_tables must be 2-dimensional"):
        slot_mapping([0], [0], np.array([1]), 4)
    with pytest.raises(BatchError, match="positions must hold integers"):
        slot_mapping([0.5], [0], np.array([[1]]), 4)


# -- DCP: the reference by counting --------------------------------------------------------


def _reference_slot(p: int, table: list[int], bs: int, d: int, inter: int, rank: int) -> int:
    """Count the owner's earlier tokens: the k-th token a rank owns goes to block k // bs."""
    owner = (p // inter) % d
    if owner != rank:
        return PAD_SLOT_ID
    k = sum(1 for q in range(p) if (q // inter) % d == owner)
    return table[k // bs] * bs + k % bs


@settings(max_examples=60, deadline=None)
@given(
    dcp_size=st.sampled_from([1, 2, 4]),
    inter_bs=st.sampled_from([(1, 1), (1, 4), (2, 4), (4, 4), (2, 8)]),
    positions=st.lists(st.integers(0, 60), min_size=1, max_size=20),
)
def test_dcp_matches_counting_reference(dcp_size, inter_bs, positions):
    interleave, bs = inter_bs
    table = [100 + 3 * j for j in range(64)]
    req = [0] * len(positions)
    owners = np.zeros(len(positions), dtype=np.int64)
    for rank in range(dcp_size):
        got = slot_mapping(
            positions, req, np.array([table]), bs,
            dcp_size=dcp_size, dcp_rank=rank, interleave=interleave,
        )
        want = [_reference_slot(p, table, bs, dcp_size, interleave, rank) for p in positions]
        assert got.tolist() == want
        owners += got != PAD_SLOT_ID
    assert (owners == 1).all(), "every token has exactly one owning DCP rank"


# -- gathered mapping: each real token written exactly once ---------------------------------


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 6))
    prefilling = draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs))
    scheduled = [draw(st.integers(1, 40) if p else st.integers(1, 4)) for p in prefilling]
    computed = [draw(st.integers(0, 50)) for _ in range(num_reqs)]
    return scheduled, prefilling, computed


def _distinct_tables(num_reqs: int, width: int = 32) -> np.ndarray:
    return np.arange(num_reqs * width, dtype=np.int64).reshape(num_reqs, width)[:, ::-1] + 5


@settings(max_examples=150, deadline=None)
@given(batch=batches(), pcp_size=st.integers(1, 8), chunking=st.sampled_from(["ceil", "balanced"]))
def test_gathered_mapping_writes_each_token_once(batch, pcp_size, chunking):
    scheduled, prefilling, computed = batch
    plan = plan_batch(scheduled, prefilling, computed, pcp_size, chunking=chunking)
    positions, req_idx = global_token_layout(plan)
    global_slots = slot_mapping(positions, req_idx, _distinct_tables(len(scheduled)), 4)
    assert np.unique(global_slots).size == plan.num_tokens  # distinct tables, distinct slots

    gathered = gathered_slot_mapping(global_slots, plan)
    assert gathered.shape == (pcp_size * plan.num_tokens_padded,)
    written = gathered != PAD_SLOT_ID
    assert np.array_equal(written, plan.kv_write_mask)
    assert sorted(gathered[written].tolist()) == sorted(global_slots.tolist())
    # Every written row carries its own token's slot.
    assert np.array_equal(gathered[written], global_slots[plan.padded_gather_idx[written]])


def test_gathered_worked_example():
    # DESIGN.md worked example; request 0 at 37 in block 7 (bs 16), request 1 in block 2.
    plan = plan_batch([1, 10], [0, 1], [37, 0], 2)
    positions, req_idx = global_token_layout(plan)
    assert positions.tolist() == [37] + list(range(10))
    assert req_idx.tolist() == [0] + [1] * 10
    global_slots = slot_mapping(positions, req_idx, np.array([[5, 6, 7], [2, 3, -1]]), 16)
    gathered = gathered_slot_mapping(global_slots, plan)
    # rank 0: [0 | 10 | 1 2 3] + 2 padding; rank 1: the decode copy is not written again.
    assert gathered.tolist() == [117, 41, 32, 33, 34, -1, -1, -1, 35, 36, 37, 38, 39, 40]


def test_gathered_length_mismatch():
    plan = plan_batch([1, 10], [0, 1], [37, 0], 2)
    with pytest.raises(BatchError, match="global_slots has 10 entries, the plan has 11"):
        gathered_slot_mapping(np.zeros(10, dtype=np.int64), plan)


def test_dummy_slot_mapping():
    assert dummy_slot_mapping(3).tolist() == [-1, -1, -1]
    assert dummy_slot_mapping(0).shape == (0,)
    with pytest.raises(BatchError, match="num_tokens must be an integer >= 0, got -1"):
        dummy_slot_mapping(-1)
