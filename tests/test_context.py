"""PCP attention contexts: real ones from the plan, dummy ones from the dummy alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.config import ParallelLayout, RunnerConfig
from runner_fsm.errors import BatchError, ConfigError
from runner_fsm.pcp.context import (
    PCPAttentionContext,
    PCPContextState,
    build_dummy_context,
    build_real_context,
)
from runner_fsm.pcp.kv import PAD_SLOT_ID
from runner_fsm.pcp.plan import plan_batch

WORKED_TABLES = np.array([[5, 6, 7], [2, 3, -1]])


def worked_plan():
    return plan_batch([1, 10], [0, 1], [37, 0], 2)


class Poison:
    """A saved state that fails loudly on any use."""

    def __getattribute__(self, name):
        raise AssertionError(f"dummy path read saved state attribute {name!r}")

    def __bool__(self):
        raise AssertionError("dummy path tested saved state for truth")

    def __eq__(self, other):
        raise AssertionError("dummy path compared saved state")

    __hash__ = None

    def __len__(self):
        raise AssertionError("dummy path took len of saved state")

    def __iter__(self):
        raise AssertionError("dummy path iterated saved state")


# -- real contexts -------------------------------------------------------------------------


def test_real_context_worked_example():
    plan = worked_plan()
    ctx = build_real_context(plan, 1, WORKED_TABLES, 16)
    assert not ctx.is_dummy
    assert (ctx.pcp_size, ctx.pcp_rank, ctx.num_tokens, ctx.num_tokens_padded) == (2, 1, 11, 7)
    assert ctx.global_slot_mapping.tolist() == [117] + list(range(32, 42))
    assert ctx.gathered_slot_mapping.tolist() == [
        117, 41, 32, 33, 34, -1, -1, -1, 35, 36, 37, 38, 39, 40
    ]
    assert np.array_equal(ctx.hidden_restore_idx, plan.hidden_restore_idx)
    assert np.array_equal(ctx.padded_gather_idx, plan.padded_gather_idx)
    assert np.array_equal(ctx.kv_write_mask, plan.kv_write_mask)
    assert np.array_equal(ctx.block_tables, WORKED_TABLES)
    assert ctx.local_rows() == slice(7, 14)


def test_real_context_is_frozen_and_private():
    plan = worked_plan()
    tables = WORKED_TABLES.copy()
    ctx = build_real_context(plan, 0, tables, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.pcp_rank = 1
    with pytest.raises(ValueError):
        ctx.gathered_slot_mapping[0] = 0
    tables[0, 2] = 99  # the caller's table changing later does not reach the context
    plan.hidden_restore_idx[0] = 5
    assert ctx.block_tables[0, 2] == 7 and ctx.hidden_restore_idx[0] == 0


def test_real_context_same_on_every_rank_without_dcp():
    plan = worked_plan()
    a, b = (build_real_context(plan, r, WORKED_TABLES, 16) for r in range(2))
    assert not a.same_as(b)  # pcp_rank differs
    assert a.same_as(dataclasses.replace(b, pcp_rank=0))


def test_real_context_errors():
    plan = worked_plan()
    with pytest.raises(BatchError, match=r"pcp_rank must lie in \[0, 2\), got 2"):
        build_real_context(plan, 2, WORKED_TABLES, 16)
    with pytest.raises(BatchError, match="request 1 .*no block-table row"):
        build_real_context(plan, 0, WORKED_TABLES[:1], 16)


@settings(max_examples=80, deadline=None)
@given(
    scheduled=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    decode=st.lists(st.booleans(), min_size=5, max_size=5),
    pcp_size=st.sampled_from([2, 4]),
    chunking=st.sampled_from(["ceil", "balanced"]),
)
def test_dcp_equal_to_pcp_writes_each_token_once_across_ranks(
    scheduled, decode, pcp_size, chunking
):
    prefilling = [not d for d in decode[: len(scheduled)]]
    scheduled = [s if p else min(s, 3) for s, p in zip(scheduled, prefilling)]
    plan = plan_batch(scheduled, prefilling, [7] * len(scheduled), pcp_size, chunking=chunking)
    tables = np.arange(len(scheduled) * 8).reshape(len(scheduled), 8)
    written = []
    for rank in range(pcp_size):
        ctx = build_real_context(plan, rank, tables, 4, dcp_size=pcp_size, interleave=2)
        rows = ctx.gathered_slot_mapping != PAD_SLOT_ID
        written.append(plan.padded_gather_idx[rows])
    counts = np.bincount(np.concatenate(written), minlength=plan.num_tokens)
    assert counts.tolist() == [1] * plan.num_tokens


# -- dummy contexts ------------------------------------------------------------------------


@pytest.mark.parametrize("pcp_size, pcp_rank, n", [(1, 0, 3), (2, 1, 4), (4, 2, 5), (3, 0, 0)])
def test_dummy_context_is_built_from_the_dummy(pcp_size, pcp_rank, n):
    ctx = build_dummy_context(n, pcp_size, pcp_rank, num_reqs=2, max_blocks_per_req=6)
    assert ctx.is_dummy
    assert (ctx.num_tokens, ctx.num_tokens_padded) == (n, n)
    assert ctx.gathered_slot_mapping.shape == (pcp_size * n,)
    assert (ctx.gathered_slot_mapping == PAD_SLOT_ID).all()
    assert (ctx.global_slot_mapping == PAD_SLOT_ID).all() and ctx.global_slot_mapping.shape == (n,)
    assert not ctx.kv_write_mask.any() and ctx.kv_write_mask.shape == (pcp_size * n,)
    assert ctx.hidden_restore_idx.tolist() == list(range(pcp_rank * n, (pcp_rank + 1) * n))
    assert ctx.block_tables.shape == (2, 6) and not ctx.block_tables.any()


def test_dummy_context_errors():
    with pytest.raises(BatchError, match=r"pcp_rank must lie in \[0, 2\), got 3"):
        build_dummy_context(4, 2, 3)
    with pytest.raises(BatchError, match="dummy num_tokens must be an integer >= 0, got -1"):
        build_dummy_context(-1, 2, 0)
    with pytest.raises(BatchError, match="pcp_size must be an integer >= 1, got 0"):
        build_dummy_context(4, 0, 0)


def _state_after_real(pcp_rank):
    state = PCPContextState(2, pcp_rank)
    state.for_real(worked_plan(), WORKED_TABLES, 16)
    return state


@pytest.mark.parametrize("pcp_rank", [0, 1])
def test_dummy_ignores_saved_state(pcp_rank):
    poisoned = PCPContextState(2, pcp_rank)
    poison = Poison()
    poisoned.last_real = poison
    fresh = PCPContextState(2, pcp_rank)
    after_real = _state_after_real(pcp_rank)
    saved = after_real.last_real

    shape = dict(num_reqs=2, max_blocks_per_req=3)
    results = [s.for_dummy(4, **shape) for s in (poisoned, fresh, after_real)]
    for other in results[1:]:
        assert results[0].same_as(other)
    assert results[0].same_as(build_dummy_context(4, 2, pcp_rank, **shape))
    # The saved states are left exactly as they were.
    assert poisoned.last_real is poison
    assert fresh.last_real is None
    assert after_real.last_real is saved


def test_real_step_after_dummy_sees_only_its_own_plan():
    state = PCPContextState(2, 0)
    state.for_dummy(4)
    ctx = state.for_real(worked_plan(), WORKED_TABLES, 16)
    assert state.last_real is ctx
    assert ctx.same_as(build_real_context(worked_plan(), 0, WORKED_TABLES, 16))


def test_state_rejects_plan_of_another_size():
    state = PCPContextState(4, 0)
    with pytest.raises(BatchError, match="plan is for pcp_size=2, this rank has 4"):
        state.for_real(worked_plan(), WORKED_TABLES, 16)
    assert state.last_real is None


# -- DCP: refused by the configuration until the reference model shards its cache -------------


@pytest.mark.parametrize("pcp_size", [2, 4])
def test_dcp_beyond_one_is_refused_with_the_reason(pcp_size):
    layout = ParallelLayout(pcp_size=pcp_size, dcp_size=pcp_size)
    with pytest.raises(ConfigError, match=f"dcp_size={pcp_size} is not supported: the reference model"
                                          " keeps each rank's whole KV cache"):
        RunnerConfig(layout=layout).validate()


def test_same_as_detects_array_differences():
    a = build_dummy_context(3, 2, 0)
    b = dataclasses.replace(a, gathered_slot_mapping=np.array([-1, -1, -1, -1, -1, 0]))
    c = dataclasses.replace(a, kv_write_mask=a.kv_write_mask.astype(np.int64))
    assert a.same_as(a) and not a.same_as(b) and not a.same_as(c)
    assert isinstance(a, PCPAttentionContext)
