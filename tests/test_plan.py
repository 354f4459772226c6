"""PCP plan: hand-worked examples from DESIGN.md section 3 and error handling."""

import numpy as np
import pytest

from runner_fsm.errors import BatchError
from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch


def test_worked_example_from_design():
    plan = plan_batch([1, 10], [False, True], [37, 0], 2)
    r0, r1 = plan.ranks
    assert r0.token_idx.tolist() == [0, 10, 1, 2, 3]
    assert r0.positions.tolist() == [37, 9, 0, 1, 2]
    assert r1.token_idx.tolist() == [0, 4, 5, 6, 7, 8, 9]
    assert r1.positions.tolist() == [37, 3, 4, 5, 6, 7, 8]
    assert plan.per_rank_num_tokens == (5, 7)
    assert plan.num_tokens_padded == 7
    # segments: decode, tail chunk (starts at 9), pure-prefill head chunk last
    assert r0.query_start_loc.tolist() == [0, 1, 2, 5]
    assert r0.seq_lens.tolist() == [38, 10, 3]
    assert r0.seg_req_idx.tolist() == [0, 1, 1]
    assert r1.query_start_loc.tolist() == [0, 1, 4, 7]
    assert r1.seq_lens.tolist() == [38, 6, 9]
    assert plan.padded_gather_idx.tolist() == [0, 10, 1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 8, 9]
    assert plan.kv_write_mask.tolist() == [True] * 5 + [False] * 2 + [False] + [True] * 6
    assert plan.hidden_restore_idx.tolist() == [0, 2, 3, 4, 8, 9, 10, 11, 12, 13, 1]


@pytest.mark.parametrize(
    "scheduled, prefilling, expected",
    [([80, 48], [1, 1], 64), ([3, 8], [0, 1], 7), ([18], [1], 6), ([1, 1, 1], [0, 0, 0], 3)],
)
def test_dispatch_counts_from_design(scheduled, prefilling, expected):
    assert num_tokens_for_dispatch(scheduled, prefilling, 2 if expected != 6 else 4) == expected


def test_balanced_meets_bound_where_ceil_does_not():
    ceil = plan_batch([18], [1], [0], 4)
    balanced = plan_batch([18], [1], [0], 4, chunking="balanced")
    assert ceil.per_rank_num_tokens == (3, 3, 6, 6)
    assert balanced.per_rank_num_tokens == (5, 5, 4, 4)
    assert num_tokens_for_dispatch([18], [1], 4, chunking="balanced") == 5


def test_balanced_extras_go_to_least_loaded_rank_across_requests():
    # P=2, C=4. Request 0: 5 tokens -> one extra, to rank 0 (all equal, lower rank).
    # Request 1: 5 tokens -> its extra goes to rank 1, now the least loaded.
    plan = plan_batch([5, 5], [1, 1], [0, 0], 2, chunking="balanced")
    assert plan.per_rank_num_tokens == (5, 5)
    r0_req0 = plan.ranks[0].token_idx[plan.ranks[0].req_idx == 0]
    assert sorted(r0_req0.tolist()) == [0, 1, 4]  # head chunk of 2, tail chunk of 1


def test_decode_rows_replicated_and_written_once():
    plan = plan_batch([2, 1], [0, 0], [5, 9], 3)
    for rank in plan.ranks:
        assert rank.token_idx.tolist() == [0, 1, 2]
        assert rank.positions.tolist() == [5, 6, 9]
    assert plan.kv_write_mask.tolist() == [True] * 3 + [False] * 6
    assert plan.hidden_restore_idx.tolist() == [0, 1, 2]


def test_padded_num_tokens_pads_every_rank():
    plan = plan_batch([1, 10], [0, 1], [37, 0], 2, padded_num_tokens=8)
    assert plan.num_tokens_padded == 8
    assert plan.padded_gather_idx.shape == (16,)
    assert plan.padded_gather_idx[8:].tolist() == [0, 4, 5, 6, 7, 8, 9, 0]
    assert plan.hidden_restore_idx.tolist() == [0, 2, 3, 4, 9, 10, 11, 12, 13, 14, 1]


def test_single_rank_is_identity():
    plan = plan_batch([3, 4], [0, 1], [10, 0], 1)
    assert plan.ranks[0].token_idx.tolist() == list(range(7))
    assert plan.hidden_restore_idx.tolist() == list(range(7))
    assert plan.kv_write_mask.all()


def test_chunked_prefill_continuation_is_not_pure():
    # request continues a chunked prefill at position 100: its head chunk stays in order
    plan = plan_batch([8, 8], [1, 1], [100, 0], 2)
    assert plan.ranks[0].seg_req_idx.tolist() == [0, 0, 1, 1]
    assert plan.ranks[0].positions.tolist() == [100, 101, 106, 107, 6, 7, 0, 1]


def test_empty_batch():
    plan = plan_batch([], [], [], 2)
    assert plan.per_rank_num_tokens == (0, 0)
    assert plan.num_tokens_padded == 0
    assert num_tokens_for_dispatch([], [], 2) == 0


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([1, -2], [0, 1], [0, 0], 2), {}, "num_scheduled must be >= 0, got -2 for request 1"),
        (([1, 2], [0, 1], [0, -1], 2), {}, "num_computed must be >= 0"),
        (([1, 2], [0], [0, 0], 2), {}, "got lengths 2, 1, 2"),
        (([1, 2], [0, 1], [0, 0], 0), {}, "pcp_size must be an integer >= 1"),
        (([0, 4], [0, 1], [3, 0], 2), {}, r"request 0 \(decode\) has 0 scheduled tokens"),
        (([4, 4], [1, 1], [0, 0], 2), {"max_num_tokens": 7}, "more than the capacity"),
        (([4], [1], [0], 2), {"chunking": "zigzag"}, "chunking must be"),
        (([1.5], [1], [0], 2), {}, "must hold integers"),
    ],
)
def test_bad_batches_raise_batch_error(args, kwargs, match):
    with pytest.raises(BatchError, match=match):
        plan_batch(*args, **kwargs)


def test_padding_below_widest_is_a_value_error():
    with pytest.raises(ValueError, match=r"below the widest rank-local batch \(7 tokens"):
        plan_batch([1, 10], [0, 1], [37, 0], 2, padded_num_tokens=6)


def test_accepts_numpy_arrays():
    plan = plan_batch(np.array([1, 10]), np.array([False, True]), np.array([37, 0]), 2)
    assert plan.per_rank_num_tokens == (5, 7)
