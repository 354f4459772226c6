"""The plan's fast path (no request cut: decodes only, or one rank) equals the general path."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.pcp import plan as P


@st.composite
def uncut_batches(draw):
    num_reqs = draw(st.integers(1, 12))
    pcp = draw(st.integers(1, 8))
    # one rank: prefills too (pure or continued); more ranks: decodes only
    prefilling = draw(st.lists(st.booleans() if pcp == 1 else st.just(False), min_size=num_reqs,
                               max_size=num_reqs))
    scheduled = [draw(st.integers(1, 70) if p else st.integers(1, 5)) for p in prefilling]
    computed = [draw(st.sampled_from([0, 0, 3, 17])) if p else draw(st.integers(1, 300)) for p in prefilling]
    return P._Batch(np.array(scheduled), np.array(prefilling), np.array(computed)), pcp


@settings(max_examples=300, deadline=None)
@given(uncut_batches())
def test_whole_segments_equal_the_general_cut(case):
    batch, pcp = case
    fast = P._whole_segments(batch, pcp)
    general = P._cut_segments(batch, pcp, "ceil", np.ones(batch.num_scheduled.size, dtype=bool))
    for name in ("rank", "req", "offset", "length"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
        assert getattr(fast, name).dtype == np.int64, name


def test_one_rank_moves_pure_prefills_last():
    batch = P._Batch(np.array([4, 1, 3]), np.array([True, False, True]), np.array([0, 9, 2]))
    segs = P._whole_segments(batch, 1)
    assert segs.req.tolist() == [1, 2, 0]  # the decode, the continued prefill, then the pure one
