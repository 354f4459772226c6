"""The ``mrv2`` policy in the default suite, against a per-request reference written from vLLM
MRV2's rule (`tests/test_pcp_layout_vllm.py` holds it to vLLM's own code in the vLLM venv),
and the plan's memory: a workspace, the per-thread scratch, one rank's rows on demand."""

import threading

import numpy as np
import pytest

from runner_fsm.pcp import rows
from runner_fsm.pcp.context import build_real_context
from runner_fsm.pcp.plan import PlanWorkspace, num_tokens_for_dispatch, plan_batch


def reference_mrv2(scheduled, prefilling, computed, pcp):
    """vLLM MRV2's layout with DCP off, one request at a time: prefills cut into 2P chunks of
    ceil(L / 2P) tokens, rank r taking chunks r and 2P-1-r; the k-th decode with tokens on
    rank k mod P; per rank decodes first, then prefills, each in request order."""
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    per_rank = [[] for _ in range(pcp)]  # (request, offset, length)
    k = 0
    for i, (length, pf) in enumerate(zip(scheduled, prefilling)):
        if not pf and length > 0:
            per_rank[k % pcp].append((i, 0, length))
            k += 1
    for i, (length, pf) in enumerate(zip(scheduled, prefilling)):
        if pf:
            width = -(-length // (2 * pcp))
            for r in range(pcp):
                for c in (r, 2 * pcp - 1 - r):
                    n = min(max(length - c * width, 0), width)
                    if n:
                        per_rank[r].append((i, c * width, n))
    counts = [sum(n for _, _, n in segs) for segs in per_rank]
    padded = max(counts) if counts else 0
    gathered = np.zeros(pcp * padded, dtype=np.int64)
    restore = np.zeros(int(starts[-1]), dtype=np.int64)
    mask = np.zeros(pcp * padded, dtype=bool)
    ranks = []
    for r, segs in enumerate(per_rank):
        row, positions, reqs = r * padded, [], []
        for i, offset, n in segs:
            for j in range(n):
                token = starts[i] + offset + j
                gathered[row], restore[token], mask[row] = token, row, True
                positions.append(computed[i] + offset + j)
                reqs.append(i)
                row += 1
        ranks.append((positions, reqs, [i for i, _, _ in segs]))
    return counts, gathered, mask, restore, ranks


def random_batch(rng):
    num_reqs = int(rng.integers(0, 40))
    prefilling = rng.random(num_reqs) < rng.choice([0.0, 0.3, 1.0])
    scheduled = np.where(prefilling, rng.integers(0, 300, num_reqs), rng.choice([0, 1, 1, 1, 3], num_reqs))
    computed = np.where(prefilling, rng.choice([0, 0, 512], num_reqs), rng.integers(1, 5000, num_reqs))
    return scheduled.astype(np.int64), prefilling, computed.astype(np.int64)


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("pcp", [1, 2, 3, 4, 8])
def test_mrv2_plan_equals_the_per_request_reference(pcp, native):
    rng = np.random.default_rng(pcp)
    workspace = PlanWorkspace()
    for _ in range(150):
        batch = random_batch(rng)
        counts, gathered, mask, restore, ranks = reference_mrv2(*batch, pcp)
        for ws in (None, workspace):
            plan = plan_batch(*batch, pcp, chunking="mrv2", workspace=ws, native=native)
            assert list(plan.per_rank_num_tokens) == counts
            assert num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking="mrv2",
                                           native=native) == max(counts, default=0)
            assert plan.padded_gather_idx.tolist() == gathered.tolist()
            assert plan.kv_write_mask.tolist() == mask.tolist()
            assert plan.hidden_restore_idx.tolist() == restore.tolist()
            for r in (0, pcp - 1):  # the first and the last rank's own rows
                positions, reqs, seg_reqs = ranks[r]
                rank = plan.ranks[r]
                assert rank.positions.tolist() == positions and rank.req_idx.tolist() == reqs
                assert rank.seg_req_idx.tolist() == seg_reqs
        assert np.all(rows._ONES.array == 1), "the scratch of ones was left dirty"


def test_a_workspace_is_reused_and_contexts_copy_what_they_keep():
    workspace = PlanWorkspace()
    first = plan_batch([5, 1, 9], [True, False, True], [0, 7, 0], 2, workspace=workspace)
    kept = first.hidden_restore_idx.copy()
    ctx = build_real_context(first, 0, np.zeros((3, 4), dtype=np.int64), 16)
    second = plan_batch([3, 8, 2], [False, True, True], [4, 0, 0], 2, workspace=workspace)
    # The second plan is written where the first was: the first's arrays now show it ...
    assert np.shares_memory(first.hidden_restore_idx, second.hidden_restore_idx)
    assert first.hidden_restore_idx.tolist() != kept.tolist()
    # ... but the context built from the first kept its own copy.
    assert ctx.hidden_restore_idx.tolist() == kept.tolist()
    fresh = plan_batch([3, 8, 2], [False, True, True], [4, 0, 0], 2)
    assert second.hidden_restore_idx.tolist() == fresh.hidden_restore_idx.tolist()
    assert second.padded_gather_idx.tolist() == fresh.padded_gather_idx.tolist()


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "compiled"])
def test_threads_plan_at_once_each_with_its_own_scratch(native):
    rng = np.random.default_rng(7)
    batches = [random_batch(rng) for _ in range(40)]
    expected = [reference_mrv2(*b, 4)[3].tolist() for b in batches]
    errors = []

    def plan_all(order):
        for i in order:
            got = plan_batch(*batches[i], 4, chunking="mrv2", native=native).hidden_restore_idx.tolist()
            if got != expected[i]:
                errors.append(i)

    threads = [threading.Thread(target=plan_all, args=(list(range(40))[::step],)) for step in (1, -1, 1, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_ranks_are_built_when_first_read_and_only_once():
    plan = plan_batch([6, 1, 1, 10], [True, False, False, True], [0, 3, 4, 0], 2, chunking="mrv2")
    assert isinstance(plan.ranks, tuple) and len(plan.ranks) == 2
    assert all("positions" not in vars(rank) for rank in plan.ranks)  # nothing built yet
    own = plan.ranks[1]
    positions = own.positions
    assert "positions" in vars(own) and "positions" not in vars(plan.ranks[0])
    assert own.positions is positions  # built once
    # the second decode, then chunks 1 and 2 (of 2 and 3 tokens) of requests 0 and 3
    assert own.req_idx.tolist() == [2, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3]
    assert positions.tolist() == [4, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    with pytest.raises(AttributeError):
        own.not_a_field
    positions, reqs = plan.global_rows()
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, *range(10)]
    assert reqs.tolist() == [0] * 6 + [1, 2] + [3] * 10


def test_the_replicating_grid_refuses_sharded_mrv2():
    from runner_fsm.pcp import layout

    lengths, prefilling = np.array([3, 1]), np.array([True, False])
    with pytest.raises(ValueError, match="sharded_segments"):
        layout.segment_grid(lengths, prefilling, np.zeros(2, dtype=np.int64), 2, "mrv2", dcp_size=1)
    segs, shared = layout.plan_segments(lengths, prefilling, np.zeros(2, dtype=np.int64), 2, "mrv2")
    assert not shared.any() and segs.tokens_per_rank.tolist() == [2, 2]
