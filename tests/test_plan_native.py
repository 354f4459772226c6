"""The compiled `mrv2` layout (`runner_fsm.pcp.native`, built by `make venv` or the package's own
build): there, and the same arrays as the numpy layout (tests/test_plan_mrv2.py holds both to a
per-request reference). A checkout without the library plans in numpy; this tier fails, it
never skips. Hostile sizes: tests/test_native_limits.py; the loader: tests/test_native_loader.py;
the package's build: tests/test_packaging.py."""

import os
import subprocess
import sys

import numpy as np
import pytest

from runner_fsm.errors import BatchError
from runner_fsm.pcp import native
from runner_fsm.pcp.plan import PlanWorkspace, num_tokens_for_dispatch, plan_batch


def test_the_compiled_layout_is_built_and_loaded():
    assert native.status() == {"native": True}, f"make venv builds {native.LIBRARY.name}: {native.status()}"


def _batch(rng, num_reqs, prefill_share, max_prefill):
    prefilling = rng.random(num_reqs) < prefill_share
    scheduled = np.where(prefilling, rng.integers(0, max_prefill, num_reqs), rng.choice([0, 1, 1, 4], num_reqs))
    computed = rng.integers(0, 4000, num_reqs)
    return scheduled.astype(np.int64), prefilling, computed.astype(np.int64)


def _same(a, b):
    assert a.per_rank_num_tokens == b.per_rank_num_tokens and a.num_tokens_padded == b.num_tokens_padded
    for name in ("padded_gather_idx", "kv_write_mask", "hidden_restore_idx"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    for ra, rb in zip(a.ranks, b.ranks, strict=True):
        for field in ("token_idx", "req_idx", "positions", "query_start_loc", "seq_lens", "seg_req_idx"):
            assert getattr(ra, field).tolist() == getattr(rb, field).tolist(), field
    assert a.shared.tolist() == b.shared.tolist()
    assert a.segments.length.tolist() == b.segments.length.tolist()


@pytest.mark.parametrize("pcp", [1, 2, 5, 16, 100])
def test_compiled_and_numpy_plans_are_the_same(pcp):
    rng = np.random.default_rng(100 + pcp)
    workspace = PlanWorkspace()
    for _ in range(60):
        batch = _batch(rng, int(rng.integers(0, 300)), rng.choice([0.0, 0.2, 1.0]), 3000)
        padded = None if rng.random() < 0.5 else -1
        expected = plan_batch(*batch, pcp, chunking="mrv2", native=False)
        if padded == -1:  # graph-size padding: more rows than the widest rank
            padded = expected.num_tokens_padded + int(rng.integers(1, 9))
            expected = plan_batch(*batch, pcp, chunking="mrv2", native=False, padded_num_tokens=padded)
        got = plan_batch(*batch, pcp, chunking="mrv2", native=True, workspace=workspace, padded_num_tokens=padded)
        _same(got, expected)
        assert (num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking="mrv2", native=True)
                == num_tokens_for_dispatch(batch[0], batch[1], pcp, chunking="mrv2", native=False))


def test_strided_inputs_and_a_too_small_padding():
    rng = np.random.default_rng(3)
    scheduled, prefilling, computed = _batch(rng, 64, 0.3, 500)
    wide, flags = np.zeros((64, 2), dtype=np.int64), np.zeros((64, 3), dtype=bool)
    wide[:, 0], flags[:, 1] = scheduled, prefilling  # columns: every other (third) element
    strided, strided_flags = wide[:, 0], flags[:, 1]
    assert not strided.flags.c_contiguous and not strided_flags.flags.c_contiguous
    _same(plan_batch(strided, strided_flags, computed, 4, chunking="mrv2", native=True),
          plan_batch(scheduled, prefilling, computed, 4, chunking="mrv2", native=False))
    widest = plan_batch(scheduled, prefilling, computed, 4, chunking="mrv2").num_tokens_padded
    with pytest.raises(BatchError, match="below the widest rank-local batch"):
        plan_batch(scheduled, prefilling, computed, 4, chunking="mrv2", native=True, padded_num_tokens=widest - 1)


def test_a_workspace_keeps_no_rows_of_the_plan_before():
    workspace = PlanWorkspace()
    big = plan_batch([900, 1, 1, 700], [True, False, False, True], [0, 5, 5, 0], 2, chunking="mrv2",
                     workspace=workspace, native=True)
    assert big.num_tokens_padded > 10
    small = plan_batch([3, 1, 5], [True, False, True], [0, 9, 0], 2, chunking="mrv2", workspace=workspace,
                       native=True, padded_num_tokens=8)
    fresh = plan_batch([3, 1, 5], [True, False, True], [0, 9, 0], 2, chunking="mrv2", native=False,
                       padded_num_tokens=8)
    _same(small, fresh)
    # rank 0: the decode (token 3), then chunks 0 and 3 of both prefills (tokens 0; 4, 5; the
    # chunks 3 are empty), then padding where the big plan had rows
    assert small.padded_gather_idx[:8].tolist() == [3, 0, 4, 5, 0, 0, 0, 0]
    assert small.kv_write_mask[:8].tolist() == [True] * 4 + [False] * 4


def test_only_mrv2_with_dcp_off_is_compiled(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: pytest.fail("the compiled layout was asked for"))
    plan_batch([5, 1], [True, False], [0, 3], 2, chunking="ceil")
    plan_batch([5, 1], [True, False], [0, 3], 2, chunking="mrv2", dcp_size=2)
    plan_batch([5, 1], [True, False], [0, 3], 2, chunking="mrv2", native=False)


def test_native_true_refuses_without_the_library_and_the_default_falls_back(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "status", lambda: {"native": False, "reason": "not built here"})
    with pytest.raises(BatchError, match="native=True, but the compiled layout is not available: not built here"):
        plan_batch([5, 1], [True, False], [0, 3], 2, chunking="mrv2", native=True)
    monkeypatch.undo()
    expected = plan_batch([5, 1], [True, False], [0, 3], 2, chunking="mrv2", native=True)
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "plan_into", lambda *a: pytest.fail("the compiled layout ran"))
    _same(plan_batch([5, 1], [True, False], [0, 3], 2, chunking="mrv2"), expected)  # numpy


def test_the_environment_turns_it_off():
    code = "from runner_fsm.pcp import native; print(native.status())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RUNNER_FSM_NATIVE": "0"}).stdout
    assert out.strip() == "{'native': False, 'reason': 'turned off by RUNNER_FSM_NATIVE=0'}"


def test_the_compiled_writer_never_writes_outside_its_buffers():
    lib = native.library()
    lengths, prefilling = np.array([9, 1, 1], dtype=np.int64), np.array([True, False, False])
    ints, bools = np.full(64, -7, dtype=np.int64), np.zeros(64, dtype=bool)
    scratch = np.zeros(3 * 2 + 1, dtype=np.int64)  # rows, T, 2P cursors

    def plan(padded, ints_cap, bools_cap):
        return lib.mrv2_plan(lengths.ctypes.data, prefilling.ctypes.data, 3, 2, padded, ints.ctypes.data,
                             ints_cap, bools.ctypes.data, bools_cap, scratch.ctypes.data, scratch.size)
    # rank 0: a decode, chunks 0 and 3 of the prefill (1 + 3 + 0 rows); rank 1: 1 + 3 + 3
    assert plan(6, 64, 64) == native.PADDING_TOO_SMALL
    assert scratch.tolist()[:3] == [4, 7, 11]  # rows of each rank, then T
    assert plan(-1, 7 * 2 + 11 - 1, 64) == native.NEEDS_SPACE  # one int short of P * N + T
    assert scratch.tolist()[2:4] == [11, 7]  # T and N, for the caller to size its buffers
    assert plan(-1, 64, 13) == native.NEEDS_SPACE  # one bool short of P * N
    assert ints.tolist() == [-7] * 64 and not bools.any()  # none of them wrote
    assert plan(-1, 25, 14) == 7
    assert ints[:14].tolist() == [9, 0, 1, 2, 0, 0, 0, 10, 3, 4, 5, 6, 7, 8]
    assert ints[14:25].tolist() == [1, 2, 3, 8, 9, 10, 11, 12, 13, 0, 7] and ints[25:].tolist() == [-7] * 39
    assert bools[:14].tolist() == [True] * 4 + [False] * 3 + [True] * 7 and not bools[14:].any()


def test_a_workspace_grows_to_fit_and_keeps_its_addresses_current():
    workspace = PlanWorkspace()
    for tokens in (10, 5000, 80_000, 7):
        lengths = np.array([tokens, 1, 1], dtype=np.int64)
        plan = plan_batch(lengths, [True, False, False], [0, 4, 4], 4, chunking="mrv2", workspace=workspace)
        ints, bools = workspace.buffers()
        assert workspace.addresses[:2] == (ints.ctypes.data, bools.ctypes.data)
        assert np.shares_memory(plan.hidden_restore_idx, ints)
        _same(plan, plan_batch(lengths, [True, False, False], [0, 4, 4], 4, chunking="mrv2", native=False))


def test_wrong_inputs_are_refused_before_the_c_code_reads_them():
    with pytest.raises(TypeError, match="lengths int64 and prefilling bool"):
        native.dispatch_count(np.array([3, 1], dtype=np.int32), np.array([True, False]), 2)
    with pytest.raises(TypeError, match="lengths int64 and prefilling bool"):
        native.plan_into(np.array([3, 1]), np.array([1, 0]), 2, None, PlanWorkspace())
    with pytest.raises(BatchError, match=r"padded_num_tokens must be in \[0, 2305843009213693952\], got -2"):
        native.plan_into(np.array([3, 1]), np.array([True, False]), 2, -2, PlanWorkspace())
    with pytest.raises(BatchError, match="padded_num_tokens must be >= 0, got -1"):
        plan_batch([3, 1], [True, False], [0, 2], 2, chunking="mrv2", padded_num_tokens=-1)


def _segment_columns(rank):
    """A numpy plan's rank as five columns: request, first and end token, first and end row."""
    qsl = rank.query_start_loc.tolist()
    starts = [int(rank.token_idx[a]) for a in qsl[:-1]]
    return [rank.seg_req_idx.tolist(), starts, [s + b - a for s, a, b in zip(starts, qsl, qsl[1:])], qsl[:-1], qsl[1:]]


@pytest.mark.parametrize("pcp", [1, 2, 5, 16])
def test_the_planner_plans_what_plan_batch_does_and_keeps_the_plan_before(pcp):
    """`native.Planner` (vLLM's PCP manager plans with it step after step) and `runners/pcp/segments.py`:
    the numpy plan's arrays, counts and each rank's segments, from integer arrays of any width.
    A plan stays intact while the next one is written (vLLM's CPU tensors alias it).
    Mutations that fail it: `mrv2_rank_segments` putting a prefill's tail before its head, or
    keeping empty chunks; `Planner.plan` writing every plan into one workspace."""
    rng = np.random.default_rng(200 + pcp)
    planner = native.Planner(pcp)
    before = None  # the plan before: (a copy, the arrays handed out)
    for _ in range(40):
        scheduled, prefilling, computed = _batch(rng, int(rng.integers(0, 200)), rng.choice([0.0, 0.3, 1.0]), 2000)
        expected = plan_batch(scheduled, prefilling, computed, pcp, chunking="mrv2", native=False)
        planner.load(scheduled.astype(np.int32), prefilling)
        n, per_rank, ints, mask = planner.plan(None)
        size = pcp * n
        assert (n, per_rank, planner.dispatch_count()) == (expected.num_tokens_padded,
                                                           list(expected.per_rank_num_tokens), n)
        assert ints[:size].tolist() == expected.padded_gather_idx.tolist()
        assert ints[size:].tolist() == expected.hidden_restore_idx.tolist()
        assert mask.tolist() == expected.kv_write_mask.tolist()
        for r in range(pcp):
            columns = _segment_columns(expected.ranks[r])
            assert planner.rank_segments(r) == columns
            assert native.rank_segments(scheduled, prefilling, pcp, r) == columns
        if before is not None:
            assert before[0].tolist() == before[1].tolist() and before[2].tolist() == before[3].tolist()
        before = (ints.copy(), ints, mask.copy(), mask)


def test_the_planner_knows_starts_that_begin_each_request():
    """vLLM's query_start_loc_np: the running sum (entries past the last request repeat T for
    padding), anything else is not. Mutation that fails it: `mrv2_is_running_sum` not reading
    the last entry."""
    planner = native.Planner(2)
    planner.load(np.array([3, 0, 5], dtype=np.int32), np.array([False, True, True]))
    for starts, begins in (([0, 3, 3, 8], True), ([0, 3, 3, 8, 8, 8], True), ([0, 3, 3, 8, 8, 9], False),
                           ([0, 3, 4, 8], False), ([1, 4, 4, 9], False), ([0, 3, 3], False), ([0, 3, 3, 7], False)):
        assert planner.begins_each_request(np.array(starts, dtype=np.int32)) is begins, starts
    assert planner.begins_each_request(np.concatenate([[0, 3, 3], np.full(500, 8)])) is True  # grows its buffer
    assert planner.begins_each_request(np.array([0.0, 3.0, 3.0, 8.0])) is False  # not integers
    assert planner.begins_each_request([0, 3, 3, 8]) is False  # not an array


def test_the_planner_pads_and_refuses_like_plan_batch():
    planner = native.Planner(2)
    planner.load(np.array([10, 1], dtype=np.int64), np.array([True, False]))
    n, per_rank, ints, mask = planner.plan(8)
    assert (n, per_rank, ints.size, mask.size) == (8, [5, 6], 2 * 8 + 11, 16)
    n, per_rank, ints, _ = planner.plan(5)
    assert (n, per_rank, ints.size) == (native.PADDING_TOO_SMALL, [5, 6], 0)

    with pytest.raises(BatchError, match="the compiled layout plans from a 1-D integer array"):
        planner.load(np.array([1.0, 2.0]), np.array([True, False]))
