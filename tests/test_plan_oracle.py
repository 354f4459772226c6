"""The rewritten planner is byte for byte the planner it replaced (tests/plan_oracle.py).

Random batches of every shape the planner meets: decode-only, prefill-only, mixed, fresh
and continued prefills, verify rows, prompts shorter than 2P, one rank, padding; both
policies. Every array of the plan is compared with its dtype and shape.
"""

import numpy as np
import pytest

from plan_oracle import oracle_num_tokens_for_dispatch, oracle_plan_batch
from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

RANK_FIELDS = ("token_idx", "req_idx", "positions", "query_start_loc", "seq_lens", "seg_req_idx")
PLAN_FIELDS = ("padded_gather_idx", "kv_write_mask", "hidden_restore_idx")


def assert_identical(mine, theirs):
    assert mine.pcp_size == theirs.pcp_size
    assert mine.per_rank_num_tokens == theirs.per_rank_num_tokens
    assert type(mine.per_rank_num_tokens[0]) is type(theirs.per_rank_num_tokens[0])
    assert mine.num_tokens_padded == theirs.num_tokens_padded
    pairs = [(name, getattr(mine, name), getattr(theirs, name)) for name in PLAN_FIELDS]
    for r, (a, b) in enumerate(zip(mine.ranks, theirs.ranks, strict=True)):
        pairs += [(f"rank {r} {name}", getattr(a, name), getattr(b, name)) for name in RANK_FIELDS]
    for name, a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), (name, a, b)


def random_batch(rng, max_reqs=40):
    num_reqs = int(rng.integers(0, max_reqs + 1))
    shape = rng.choice(["mixed", "decode", "prefill", "short"])
    prefilling = {"mixed": rng.random(num_reqs) < 0.4, "decode": np.zeros(num_reqs, bool),
                  "prefill": np.ones(num_reqs, bool), "short": rng.random(num_reqs) < 0.7}[shape]
    top = 12 if shape == "short" else 300
    scheduled = np.where(prefilling, rng.integers(1, top + 1, num_reqs), rng.choice([1, 1, 1, 3, 5], num_reqs))
    computed = np.where(rng.random(num_reqs) < 0.5, 0, rng.integers(1, 5000, num_reqs))
    computed = np.where(prefilling, computed, np.maximum(computed, 1))
    return scheduled.astype(np.int64), prefilling, computed.astype(np.int64)


@pytest.mark.parametrize("policy", ["ceil", "balanced"])
@pytest.mark.parametrize("seed", range(4))
def test_rewrite_equals_oracle_on_random_batches(policy, seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        batch = random_batch(rng)
        pcp = int(rng.integers(1, 9))
        pad = None
        if rng.random() < 0.3:
            pad = oracle_num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking=policy) + int(rng.integers(0, 5))
        assert_identical(plan_batch(*batch, pcp, chunking=policy, padded_num_tokens=pad),
                         oracle_plan_batch(*batch, pcp, chunking=policy, padded_num_tokens=pad))
        assert (num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking=policy)
                == oracle_num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking=policy))


@pytest.mark.parametrize("policy", ["ceil", "balanced"])
def test_rewrite_equals_oracle_on_lists_and_empty(policy):
    for args in (([], [], [], 3), ([0, 0], [True, False], [0, 4], 2), ([18], [1], [0], 4),
                 ([1, 10], [False, True], [37, 0], 2), ([5, 5, 7, 1], [1, 1, 1, 0], [0, 3, 0, 9], 2)):
        assert_identical(plan_batch(*args, chunking=policy), oracle_plan_batch(*args, chunking=policy))


def test_rewrite_equals_oracle_on_the_benchmark_batch():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_plan import mixed_batch

    batch = mixed_batch(512)
    for pcp in (2, 4, 8):
        for policy in ("ceil", "balanced"):
            assert_identical(plan_batch(*batch, pcp, chunking=policy), oracle_plan_batch(*batch, pcp, chunking=policy))
