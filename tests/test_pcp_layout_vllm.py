"""vLLM tier: the ``mrv2`` policy is vLLM MRV2's own PCP layout, and `fast_pcp_layout`
installs it into MRV2's `PCPManager` only where the installed vLLM is that layout.

The reference is vLLM's own `PCPManager._build_batch_layout` and
`get_num_tokens_for_dispatch`, called on a manager made through its public constructor
(no buffers and no block tables: the layout needs neither), on thousands of random batches:
decodes and verify rows, fresh and continued prefills, prompts shorter than 2P, requests
with 0 tokens, padding; P = 1..8; decodes sharded (DCP = 1, vLLM's rule) and replicated
with short prefills replicated too (DCP = 2, 4).

    PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -q -m vllm tests/test_pcp_layout_vllm.py

`fast_pcp_layout` is installed on manager instances only, by FSMWorker's MRV2 adapter once the
KV cache built the manager; it writes with the compiled layout where it loads (DCP 1) and with
numpy otherwise, and both writers are held to vLLM's layout here.
"""

import numpy as np
import pytest

from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]  # no engine: once, in the V1 leg

CASES_PER_CONFIG = 700  # x 3 DCP configurations x 2 seeds: 4,200 random batches


def manager(pcp, dcp, *, cls=None, rank=0):
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    return (cls or PCPManager)(pcp_world_size=pcp, pcp_rank=rank, device=torch.device("cpu"),
                               shard_decode_requests=dcp == 1, dcp_world_size=dcp)


def random_batch(rng):
    num_reqs = int(rng.integers(0, 33))
    prefilling = rng.random(num_reqs) < rng.choice([0.0, 0.3, 0.7, 1.0])
    top = int(rng.choice([12, 40, 400]))
    scheduled = np.where(prefilling, rng.integers(1, top + 1, num_reqs), rng.choice([1, 1, 2, 3], num_reqs))
    scheduled = np.where(rng.random(num_reqs) < 0.05, 0, scheduled)  # MRV2 skips a row with no tokens
    computed = np.where(prefilling & (rng.random(num_reqs) < 0.5), 0, rng.integers(1, 3000, num_reqs))
    return scheduled.astype(np.int32), computed.astype(np.int32), prefilling


def vllm_layout(mgr, scheduled, computed, prefilling, padded=None):
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    segments, per_rank = mgr._build_batch_layout(scheduled, computed, prefilling, qsl, padded_num_tokens=padded)
    return ([list(s) for s in segments], list(per_rank), mgr._padded_gather_idx.numpy().copy(),
            mgr._gathered_kv_write_mask.numpy().copy(), mgr._hidden_restore_idx.numpy().copy(),
            mgr.get_num_tokens_for_dispatch(scheduled, prefilling))


def plan_as_vllm(plan, dispatch):
    """Our plan in vLLM's terms: per rank its RankSegments, the counts, the three arrays."""
    from vllm.v1.worker.gpu.pcp_manager import RankSegment

    segments = []
    for rank in plan.ranks:
        qsl = rank.query_start_loc.tolist()
        segments.append([
            RankSegment(global_batch_req_idx=int(req), global_batch_slice=slice(int(rank.token_idx[a]),
                        int(rank.token_idx[a]) + b - a), rank_local_batch_slice=slice(a, b))
            for req, a, b in zip(rank.seg_req_idx.tolist(), qsl, qsl[1:])])
    return (segments, list(plan.per_rank_num_tokens), plan.padded_gather_idx, plan.kv_write_mask,
            plan.hidden_restore_idx, dispatch)


def assert_same_layout(ours, theirs):
    names = ("segments_by_rank", "per_rank_num_tokens", "padded_gather_idx", "kv_write_mask",
             "hidden_restore_idx", "num_tokens_for_dispatch")
    for name, a, b in zip(names, ours, theirs, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (name, a, b)
        else:
            assert a == b, (name, a, b)


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_mrv2_policy_equals_vllm_build_batch_layout(dcp, seed):
    """Equal layouts on every random batch, and the batches compared cover what they claim to
    (counted from the batches themselves, after each comparison): every P, prefills cut over the
    ranks, decodes, both in one batch, padding. Mutation seen to fail this: `random_batch`
    making no prefill (`prefilling` all False), which every comparison alone would let pass."""
    rng = np.random.default_rng(100 * dcp + seed)
    covered = {"pcp": set(), "prefill": 0, "decode": 0, "mixed": 0, "padded": 0}
    for _ in range(CASES_PER_CONFIG):
        pcp = int(rng.integers(1, 9))
        scheduled, computed, prefilling = random_batch(rng)
        mgr = manager(pcp, dcp)
        padded = None
        if rng.random() < 0.3 and scheduled.sum():
            padded = mgr.get_num_tokens_for_dispatch(scheduled, prefilling) + int(rng.integers(0, 4))
        theirs = vllm_layout(mgr, scheduled, computed, prefilling, padded)
        # with DCP off both writers: the compiled layout (runner_fsm.pcp.native) and numpy's
        for native in ((True, False) if dcp == 1 else (None,)):
            plan = plan_batch(scheduled, prefilling, computed, pcp, chunking="mrv2", dcp_size=dcp,
                              padded_num_tokens=padded, native=native)
            dispatch = num_tokens_for_dispatch(scheduled, prefilling, pcp, chunking="mrv2", dcp_size=dcp,
                                               native=native)
            assert_same_layout(plan_as_vllm(plan, dispatch), theirs)
        live = scheduled > 0
        has_prefill, has_decode = bool((prefilling & live).any()), bool((~prefilling & live).any())
        covered["pcp"].add(pcp)
        covered["prefill"] += has_prefill
        covered["decode"] += has_decode
        covered["mixed"] += has_prefill and has_decode
        covered["padded"] += padded is not None
    assert covered["pcp"] == set(range(1, 9)), covered
    assert min(covered[k] for k in ("prefill", "decode", "mixed", "padded")) >= CASES_PER_CONFIG // 10, covered


def test_mrv2_policy_equals_vllm_on_the_benchmark_batch():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_plan import mixed_batch

    scheduled, prefilling, computed = mixed_batch(512)
    for pcp in (2, 4, 8):
        theirs = vllm_layout(manager(pcp, 1), scheduled, computed, prefilling)
        for native in (True, False):
            plan = plan_batch(scheduled, prefilling, computed, pcp, chunking="mrv2", native=native)
            dispatch = num_tokens_for_dispatch(scheduled, prefilling, pcp, chunking="mrv2", native=native)
            assert_same_layout(plan_as_vllm(plan, dispatch), theirs)


# --- fast_pcp_layout: the installer ---------------------------------------------------------

FAST = "runner_fsm.integrations.vllm.runners.pcp_layout"


def test_installs_on_a_manager_instance_and_refuses_a_class():
    """Mutation that fails it: `install_fast_pcp_layout` patching `type(manager)` (every
    manager of the process would get it)."""
    import vllm
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

    assert vllm.__version__ == "0.32.0"
    mgr = manager(2, 1)
    description = install_fast_pcp_layout(mgr)
    assert description == {"installed": True, "target": "vllm.v1.worker.gpu.pcp_manager.PCPManager instance",
                           "vllm": "0.32.0", "methods": ["_build_batch_layout", "get_num_tokens_for_dispatch"],
                           "policy": "runner_fsm.pcp.plan chunking='mrv2'",
                           "writer": "compiled layout (runner_fsm.pcp.native)"}
    assert install_fast_pcp_layout(mgr)["reason"] == "already installed"
    assert mgr._build_batch_layout.__func__.__module__ == FAST
    refused = install_fast_pcp_layout(PCPManager)
    assert refused["installed"] is False and refused["target"] == "vllm.v1.worker.gpu.pcp_manager.PCPManager"
    assert refused["reason"] == "installs on a PCPManager instance only: a class is shared by every manager built from it"
    for method in (PCPManager._build_batch_layout, manager(2, 1)._build_batch_layout.__func__):
        assert method.__module__ == "vllm.v1.worker.gpu.pcp_manager"  # the class and other managers untouched


WRITERS = [(1, "compiled"), (1, "numpy"), (2, "numpy")]  # (DCP, the writer it installs with)


def fast_manager(pcp, dcp, writer, monkeypatch, rank=0):
    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout
    from runner_fsm.pcp import native

    mgr = manager(pcp, dcp, rank=rank)
    with monkeypatch.context() as patch:
        if writer == "numpy":
            patch.setattr(native, "status", lambda: {"native": False, "reason": "left off by the test"})
        description = install_fast_pcp_layout(mgr)
    assert description["installed"] and description["writer"].startswith(writer), description
    assert ("_runner_fsm_fast_pcp_layout_planner" in mgr.__dict__) == (writer == "compiled")
    return mgr


@pytest.mark.parametrize(("dcp", "writer"), WRITERS)
def test_installed_manager_lays_out_what_vllm_does(dcp, writer, monkeypatch):
    """Every rank's segments (the manager's own rank and the others, read later), the arrays,
    the dispatch count, on managers of every rank. Mutations that fail it: `Planner.batch`
    returning the staged arrays (a later load changes another rank's segments), `runners/pcp/segments.py`
    swapping the global and local slices."""
    rng = np.random.default_rng(7 + dcp + len(writer))
    for _ in range(300):
        pcp = int(rng.integers(1, 9))
        scheduled, computed, prefilling = random_batch(rng)
        fast, plain = fast_manager(pcp, dcp, writer, monkeypatch, rank=int(rng.integers(0, pcp))), manager(pcp, dcp)
        padded = None
        if rng.random() < 0.3 and scheduled.sum():
            padded = plain.get_num_tokens_for_dispatch(scheduled, prefilling) + int(rng.integers(0, 4))
        theirs = vllm_layout(plain, scheduled, computed, prefilling, padded)
        assert_same_layout(vllm_layout(fast, scheduled, computed, prefilling, padded), theirs)
        # another rank's segments read after the manager planned another batch
        qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        segments, _ = fast._build_batch_layout(scheduled, computed, prefilling, qsl, padded_num_tokens=padded)
        fast.get_num_tokens_for_dispatch(np.array([5, 1, 2], np.int32), np.array([True, False, True]))
        assert [list(s) for s in segments] == theirs[0]


@pytest.mark.parametrize(("dcp", "writer"), WRITERS)
def test_a_steps_layout_stays_intact_while_the_next_is_built(dcp, writer, monkeypatch):
    """On a CPU device the manager's tensors alias the layout's arrays: the step before's must
    survive the next step's layout (vLLM reads a step's within it; one step of slack).
    Mutation that fails it: the compiled writer's `Planner.plan` writing into one workspace."""
    rng = np.random.default_rng(40 + dcp)
    fast = fast_manager(4, dcp, writer, monkeypatch)
    kept = None
    for _ in range(30):
        scheduled, computed, prefilling = random_batch(rng)
        qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        fast._build_batch_layout(scheduled, computed, prefilling, qsl)
        tensors = (fast._padded_gather_idx, fast._gathered_kv_write_mask, fast._hidden_restore_idx)
        if kept is not None:
            assert all(t.tolist() == copy for t, copy in zip(*kept))
        kept = (tensors, [t.tolist() for t in tensors])


@pytest.mark.parametrize(("dcp", "writer"), WRITERS)
def test_installed_layout_refuses_padding_below_the_widest_like_vllm(dcp, writer, monkeypatch):
    scheduled, prefilling = np.array([1, 10], np.int32), np.array([False, True])
    for mgr in (fast_manager(2, dcp, writer, monkeypatch), manager(2, dcp)):
        widest = 6 if dcp == 1 else 7  # DCP 2: the decode replicated on both ranks
        with pytest.raises(ValueError, match=f"smaller than the largest rank-local batch: 5 < {widest}"):
            mgr._build_batch_layout(scheduled, np.zeros(2, np.int32), prefilling, np.array([0, 1, 11]), 5)


def test_not_installed_where_the_layout_is_not_the_pinned_one(monkeypatch):
    import torch
    import vllm
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from runner_fsm.integrations.vllm.runners import pcp_layout

    changed = type("Changed", (PCPManager,), {
        "_iter_rank_chunks": lambda self, rank, num_scheduled_tokens, is_prefilling, extra=0: iter(())})
    mgr = changed(pcp_world_size=2, pcp_rank=0, device=torch.device("cpu"), shard_decode_requests=True)
    description = pcp_layout.install_fast_pcp_layout(mgr)
    assert description["installed"] is False
    assert "PCPManager._iter_rank_chunks(self, rank, num_scheduled_tokens, is_prefilling, extra=0)" in description["reason"]
    assert "_runner_fsm" not in str(mgr.__dict__)

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    other = manager(2, 1)
    description = pcp_layout.install_fast_pcp_layout(other)
    assert description["installed"] is False
    assert description["reason"] == "vLLM 0.34.0: no pins for this release (pinned: 0.32.0, 0.33.0)"
    assert "runner_fsm" not in other._build_batch_layout.__func__.__module__

    # 0.33.0's pinned bodies are 0.32.0's, byte for byte: the layout stays on there
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert pcp_layout.install_fast_pcp_layout(manager(2, 1))["installed"] is True


def test_not_installed_where_rank_segment_is_not_the_pinned_one(monkeypatch):
    """RankSegments are made without their `__init__` (for speed): only for the class pinned."""
    import dataclasses

    from vllm.v1.worker.gpu import pcp_manager

    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

    @dataclasses.dataclass(frozen=True)
    class RankSegment:
        global_batch_req_idx: int
        global_batch_slice: slice
        rank_local_batch_slice: slice

        def __post_init__(self):
            raise AssertionError("a segment made without its __init__ skips this")
    monkeypatch.setattr(pcp_manager, "RankSegment", RankSegment)
    description = install_fast_pcp_layout(manager(2, 1))
    assert description["installed"] is False
    assert description["reason"].startswith("RankSegment: source digest ") and description["reason"].endswith(
        ", pinned 9e08c4b26c3b2bb4")


def test_not_installed_on_something_else():
    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

    description = install_fast_pcp_layout(object())
    assert description["installed"] is False and "is not a vLLM PCPManager" in description["reason"]


@pytest.mark.parametrize("writer", ["compiled", "numpy"])
def test_installed_steps_aside_for_what_it_was_not_pinned_on(writer, monkeypatch):
    """Sharded decodes with DCP > 1 (a combination vLLM never builds), a query_start_loc that
    is not the running sum, and a batch the layout refuses: vLLM's own method answers."""
    import torch

    calls = []

    def spy_on(mgr):
        original = mgr._runner_fsm_fast_pcp_layout_original__build_batch_layout

        def spy(*args, **kwargs):
            calls.append(args)
            return original(*args, **kwargs)
        mgr._runner_fsm_fast_pcp_layout_original__build_batch_layout = spy
        return mgr

    scheduled, computed, prefilling = np.array([3, 9], np.int32), np.zeros(2, np.int32), np.array([False, True])
    odd = manager(2, 2)
    odd.shard_decode_requests = True
    from runner_fsm.integrations.vllm.runners.pcp_layout import install_fast_pcp_layout

    assert install_fast_pcp_layout(odd)["installed"]
    spy_on(odd)._build_batch_layout(scheduled, computed, prefilling, np.array([0, 3, 12]))
    assert len(calls) == 1
    plain = spy_on(fast_manager(2, 1, writer, monkeypatch))
    plain._build_batch_layout(scheduled, computed, prefilling, np.array([0, 3, 12]))
    assert len(calls) == 1  # the pinned case: ours
    plain._build_batch_layout(scheduled, computed, prefilling, np.array([0, 4, 13]))
    assert len(calls) == 2  # starts that are not the running sum: vLLM's
    with pytest.raises(ValueError, match="Maximum allowed dimension exceeded"):  # numpy's, in vLLM's method
        plain._build_batch_layout(scheduled, computed, prefilling, np.array([0, 3, 12]), padded_num_tokens=2**64 + 8)
    assert len(calls) == 3  # a padding the layout refuses: vLLM's own method answers, as without it
    assert isinstance(odd.device, torch.device)


# --- fast_pcp_layout in FSMWorker's MRV2 adapter ----------------------------------------------

def mrv2_adapter(pcp, mgr):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner

    parallel = SimpleNamespace(prefill_context_parallel_size=pcp, decode_context_parallel_size=1)
    return MRV2Runner(SimpleNamespace(pcp_manager=mgr, pcp_manager_cls=PCPManager, parallel_config=parallel))


def test_the_mrv2_adapter_installs_on_its_manager_once_built_under_the_evidence():
    """Checked at start-up (the log's first record), installed when the KV cache built the
    manager (`attach_kv`), before PCPEvidence wraps the dispatch count, which then calls ours.
    Mutations that fail it: installing in `install_fast_pcp_layout` on `pcp_manager_cls` (the
    class changes), installing after PCPEvidence (the evidence's wrapper is replaced)."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    mgr = manager(2, 1)
    adapter = mrv2_adapter(2, None)
    description = adapter.install_fast_pcp_layout()
    assert description["installed"] is True and description["writer"] == "compiled layout (runner_fsm.pcp.native)"
    assert PCPManager._build_batch_layout.__module__ == "vllm.v1.worker.gpu.pcp_manager"
    adapter.runner.pcp_manager = mgr  # what initialize_kv_cache does
    adapter.attach_kv()
    assert adapter.pcp is not None and mgr._build_batch_layout.__func__.__module__ == FAST
    evidence = mgr.__dict__["get_num_tokens_for_dispatch"]
    assert evidence.__wrapped__.__func__.__module__ == FAST  # the evidence wraps ours
    scheduled, prefilling = np.array([1, 10, 3], np.int32), np.array([False, True, False])
    assert mgr.get_num_tokens_for_dispatch(scheduled, prefilling) == manager(2, 1).get_num_tokens_for_dispatch(
        scheduled, prefilling)
    assert PCPManager._build_batch_layout.__module__ == "vllm.v1.worker.gpu.pcp_manager"


def test_the_mrv2_adapter_says_so_without_pcp_and_fails_loudly_if_the_manager_refuses():
    assert mrv2_adapter(1, None).install_fast_pcp_layout() == {
        "installed": False, "reason": "PCP 1: the runner builds no PCP manager"}
    mgr = manager(2, 1)
    del mgr.pcp_rank  # a manager unlike the class checked at start-up
    adapter = mrv2_adapter(2, mgr)
    assert adapter.install_fast_pcp_layout()["installed"] is True
    with pytest.raises(RuntimeError, match="fast_pcp_layout: not installed on the PCP manager: instance lacks pcp_rank"):
        adapter.attach_kv()
