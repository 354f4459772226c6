"""Batches that cut no request (decodes only, or one rank) skip the chunk arithmetic
(the whole-request grid alone); their plan equals the old planner's general cut."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import plan_oracle as O
from runner_fsm.pcp import layout
from runner_fsm.pcp.plan import plan_batch
from test_plan_oracle import assert_identical


@st.composite
def uncut_batches(draw):
    num_reqs = draw(st.integers(1, 12))
    pcp = draw(st.integers(1, 8))
    # one rank: prefills too (pure or continued); more ranks: decodes only
    prefilling = draw(st.lists(st.booleans() if pcp == 1 else st.just(False), min_size=num_reqs,
                               max_size=num_reqs))
    scheduled = [draw(st.integers(1, 70) if p else st.integers(1, 5)) for p in prefilling]
    computed = [draw(st.sampled_from([0, 0, 3, 17])) if p else draw(st.integers(1, 300)) for p in prefilling]
    return np.array(scheduled), np.array(prefilling), np.array(computed), pcp


@settings(max_examples=300, deadline=None)
@given(uncut_batches())
def test_uncut_plan_equals_the_general_cut(case):
    scheduled, prefilling, computed, pcp = case
    batch = O._Batch(scheduled.astype(np.int64), prefilling, computed.astype(np.int64))
    general = O._cut_segments(batch, pcp, "ceil", np.ones(scheduled.size, dtype=bool))
    segs = layout.segments(layout.segment_grid(batch.num_scheduled, prefilling, batch.num_computed, pcp, "ceil"))
    for name in ("rank", "req", "offset", "length"):
        assert getattr(segs, name).tolist() == getattr(general, name).tolist(), name
        assert getattr(segs, name).dtype == np.int64, name
    assert_identical(plan_batch(*case), O.oracle_plan_batch(*case))


def test_one_rank_moves_pure_prefills_last():
    plan = plan_batch([4, 1, 3], [True, False, True], [0, 9, 2], 1)
    assert plan.ranks[0].seg_req_idx.tolist() == [1, 2, 0]  # the decode, the continued prefill, then the pure one
