"""PCP plan properties over random batches (hypothesis), P in 1..8, both policies."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

POLICIES = st.sampled_from(["ceil", "balanced"])


@st.composite
def batches(draw):
    num_reqs = draw(st.integers(1, 12))
    prefilling = draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs))
    scheduled = [draw(st.integers(1, 70) if p else st.integers(1, 5)) for p in prefilling]
    computed = [draw(st.sampled_from([0, 0, 3, 17, 200])) if p else draw(st.integers(1, 300))
                for p in prefilling]
    pcp = draw(st.integers(1, 8))
    return np.array(scheduled), np.array(prefilling), np.array(computed), pcp


def _global_positions(scheduled, computed):
    return np.concatenate([c + np.arange(n) for n, c in zip(scheduled, computed)])


@settings(max_examples=300, deadline=None)
@given(batches(), POLICIES)
def test_tokens_partitioned_and_restored(batch, policy):
    scheduled, prefilling, computed, pcp = batch
    plan = plan_batch(scheduled, prefilling, computed, pcp, chunking=policy)
    total = int(scheduled.sum())
    req_of_token = np.repeat(np.arange(scheduled.size), scheduled)
    decode_token = ~prefilling[req_of_token]

    seen = np.zeros((pcp, total), dtype=int)
    for r, rank in enumerate(plan.ranks):
        np.add.at(seen[r], rank.token_idx, 1)
        assert rank.num_tokens == plan.per_rank_num_tokens[r]
        assert (rank.positions == _global_positions(scheduled, computed)[rank.token_idx]).all()
        assert (rank.req_idx == req_of_token[rank.token_idx]).all()
        assert rank.query_start_loc[-1] == rank.num_tokens
    # each prefill token on exactly one rank, each decode token on every rank
    assert (seen.sum(axis=0)[~decode_token] == 1).all()
    assert (seen[:, decode_token] == 1).all()

    restore, mask, gathered = plan.hidden_restore_idx, plan.kv_write_mask, plan.padded_gather_idx
    assert sorted(restore.tolist()) == np.flatnonzero(mask).tolist()  # one-to-one onto mask
    assert (gathered[restore] == np.arange(total)).all()
    assert plan.num_tokens_padded == max(plan.per_rank_num_tokens)


@settings(max_examples=300, deadline=None)
@given(batches(), POLICIES, st.integers(0, 400))
def test_dispatch_count_is_widest_rank_and_ignores_num_computed(batch, policy, shift):
    scheduled, prefilling, computed, pcp = batch
    plan = plan_batch(scheduled, prefilling, computed, pcp, chunking=policy)
    n = num_tokens_for_dispatch(scheduled, prefilling, pcp, chunking=policy)
    assert n == plan.num_tokens_padded
    shifted = plan_batch(scheduled, prefilling, computed + shift, pcp, chunking=policy)
    assert shifted.per_rank_num_tokens == plan.per_rank_num_tokens


@settings(max_examples=300, deadline=None)
@given(batches())
def test_balanced_at_lower_bound_and_never_wider_than_ceil(batch):
    scheduled, prefilling, computed, pcp = batch
    ceil = plan_batch(scheduled, prefilling, computed, pcp)
    balanced = plan_batch(scheduled, prefilling, computed, pcp, chunking="balanced")
    decode = int(scheduled[~prefilling].sum())
    prefill = int(scheduled[prefilling].sum())
    assert balanced.num_tokens_padded == decode + -(-prefill // pcp)
    assert balanced.num_tokens_padded <= ceil.num_tokens_padded
    assert max(balanced.per_rank_num_tokens) - min(balanced.per_rank_num_tokens) <= 1
    # every chunk floor(L/C) or one more: each rank holds 2*floor(L/C) .. +2 of a prefill
    for i in np.flatnonzero(prefilling):
        base = scheduled[i] // (2 * pcp)
        for rank in balanced.ranks:
            held = int((rank.req_idx == i).sum())
            assert 2 * base <= held <= 2 * base + 2


@settings(max_examples=200, deadline=None)
@given(batches(), POLICIES)
def test_rank_order_decodes_first_pure_prefill_last(batch, policy):
    scheduled, prefilling, computed, pcp = batch
    plan = plan_batch(scheduled, prefilling, computed, pcp, chunking=policy)
    for rank in plan.ranks:
        starts = rank.positions[rank.query_start_loc[:-1]]
        pure = prefilling[rank.seg_req_idx] & (starts == 0)
        # once a pure prefill segment appears, only pure prefill segments follow
        if pure.any():
            assert pure[np.argmax(pure):].all()
        # non-pure segments keep request order
        assert (np.diff(rank.seg_req_idx[~pure]) >= 0).all()
        assert (rank.seq_lens == starts + np.diff(rank.query_start_loc)).all()
