"""vLLM tier: the ``mrv2`` policy is vLLM MRV2's own PCP layout, and `fast_pcp_layout`
installs it into MRV2's `PCPManager` only where the installed vLLM is that layout.

The reference is vLLM's own `PCPManager._build_batch_layout` and
`get_num_tokens_for_dispatch`, called on a manager made through its public constructor
(no buffers and no block tables: the layout needs neither), on thousands of random batches:
decodes and verify rows, fresh and continued prefills, prompts shorter than 2P, requests
with 0 tokens, padding; P = 1..8; decodes sharded (DCP = 1, vLLM's rule) and replicated
with short prefills replicated too (DCP = 2, 4).

    PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -q -m vllm tests/test_pcp_layout_vllm.py
"""

import numpy as np
import pytest

from runner_fsm.pcp.plan import num_tokens_for_dispatch, plan_batch

pytestmark = pytest.mark.vllm

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

def fresh_subclass():
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    return type("ManagerUnderTest", (PCPManager,), {})


def test_installs_on_vllm_0_32_0_class_and_says_so():
    import vllm

    from runner_fsm.integrations.vllm.pcp_layout import install_fast_pcp_layout

    assert vllm.__version__ == "0.32.0"
    cls = fresh_subclass()
    description = install_fast_pcp_layout(cls)
    assert description["installed"] is True and "reason" not in description
    assert description["vllm"] == "0.32.0"
    assert description["target"].endswith("ManagerUnderTest")
    assert set(description["methods"]) == {"_build_batch_layout", "get_num_tokens_for_dispatch"}
    assert install_fast_pcp_layout(cls)["reason"] == "already installed"
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    assert "runner_fsm" not in PCPManager._build_batch_layout.__module__  # the base class untouched


@pytest.mark.parametrize("dcp", [1, 2])
@pytest.mark.parametrize("on", ["class", "instance"])
def test_installed_manager_lays_out_what_vllm_does(dcp, on):
    from runner_fsm.integrations.vllm.pcp_layout import install_fast_pcp_layout

    rng = np.random.default_rng(7 + dcp)
    cls = fresh_subclass()
    if on == "class":
        assert install_fast_pcp_layout(cls)["installed"]
    for _ in range(400):
        pcp = int(rng.integers(1, 9))
        scheduled, computed, prefilling = random_batch(rng)
        fast, plain = manager(pcp, dcp, cls=cls), manager(pcp, dcp)
        if on == "instance":
            assert install_fast_pcp_layout(fast)["installed"]
        assert "runner_fsm" in fast._build_batch_layout.__func__.__module__
        padded = None
        if rng.random() < 0.3 and scheduled.sum():
            padded = plain.get_num_tokens_for_dispatch(scheduled, prefilling) + int(rng.integers(0, 4))
        ours = vllm_layout(fast, scheduled, computed, prefilling, padded)
        assert_same_layout(ours, vllm_layout(plain, scheduled, computed, prefilling, padded))


def test_installed_layout_refuses_padding_below_the_widest_like_vllm():
    from runner_fsm.integrations.vllm.pcp_layout import install_fast_pcp_layout

    cls = fresh_subclass()
    install_fast_pcp_layout(cls)
    scheduled, prefilling = np.array([1, 10], np.int32), np.array([False, True])
    for mgr in (manager(2, 1, cls=cls), manager(2, 1)):
        with pytest.raises(ValueError, match="smaller than the largest rank-local batch: 5 < 6"):
            mgr._build_batch_layout(scheduled, np.zeros(2, np.int32), prefilling, np.array([0, 1, 11]), 5)


def test_not_installed_where_the_layout_is_not_the_pinned_one(monkeypatch):
    import vllm

    from runner_fsm.integrations.vllm import pcp_layout

    changed = type("Changed", (fresh_subclass(),), {
        "_iter_rank_chunks": lambda self, rank, num_scheduled_tokens, is_prefilling, extra=0: iter(())})
    description = pcp_layout.install_fast_pcp_layout(changed)
    assert description["installed"] is False
    assert "PCPManager._iter_rank_chunks(self, rank, num_scheduled_tokens, is_prefilling, extra=0)" in description["reason"]
    assert "_runner_fsm" not in str(changed.__dict__)

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    other = fresh_subclass()
    description = pcp_layout.install_fast_pcp_layout(other)
    assert description["installed"] is False and description["reason"] == "vLLM 0.33.0, pinned 0.32.0"
    assert "runner_fsm" not in other._build_batch_layout.__module__


def test_not_installed_on_something_else():
    from runner_fsm.integrations.vllm.pcp_layout import install_fast_pcp_layout

    description = install_fast_pcp_layout(object())
    assert description["installed"] is False and "is not a vLLM PCPManager" in description["reason"]


def test_installed_steps_aside_for_what_it_was_not_pinned_on():
    """Sharded decodes with DCP > 1 (a combination vLLM never builds) and a
    query_start_loc that is not the running sum: vLLM's own method answers."""
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from runner_fsm.integrations.vllm.pcp_layout import install_fast_pcp_layout

    cls = fresh_subclass()
    install_fast_pcp_layout(cls)
    calls = []
    original = cls._runner_fsm_fast_pcp_layout_original__build_batch_layout

    def spy(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    cls._runner_fsm_fast_pcp_layout_original__build_batch_layout = spy
    scheduled, computed, prefilling = np.array([3, 9], np.int32), np.zeros(2, np.int32), np.array([False, True])
    odd = cls(pcp_world_size=2, pcp_rank=0, device=torch.device("cpu"), shard_decode_requests=True,
              dcp_world_size=2)
    odd._build_batch_layout(scheduled, computed, prefilling, np.array([0, 3, 12]))
    assert len(calls) == 1
    plain = manager(2, 1, cls=cls)
    plain._build_batch_layout(scheduled, computed, prefilling, np.array([0, 3, 12]))
    assert len(calls) == 1  # the pinned case: ours
    plain._build_batch_layout(scheduled, computed, prefilling, np.array([0, 4, 13]))
    assert len(calls) == 2  # starts that are not the running sum: vLLM's
    assert issubclass(cls, PCPManager)
