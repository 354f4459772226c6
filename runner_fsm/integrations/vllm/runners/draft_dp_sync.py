"""`draft_dp_sync`: the MTP/EAGLE draft's own DP agreement under PCP x DP (vLLM 0.32, Model Runner V2).

vLLM's defect (docs/vllm-mtp-pcp-dp.md). MRV2's target-dependent speculator (`propose`, the base
of MTP and EAGLE) reuses the target's DP agreement for its draft prefill instead of taking one
(`dispatch_cg_and_sync_dp(..., dp_sync_state=...)`, vLLM PR #53694: one CPU all-reduce saved per
step). That is sound while the draft prefill runs the target's batch. Under PCP it does not:
`pcp_manager.prepare_draft_prefill` makes it the PCP-local batch, and the speculator classifies
that batch as uniform from the global request count and the local token count. MRV2 shards
decodes over the PCP ranks (PCP without DCP), so in a decode step the local batch holds some of
the decodes or none, and its uniform count (None) is not the one the replicas agreed on (1+K):
`dispatch_cg_and_sync_dp` asserts "reusing a DP sync taken over a different batch" on the busy
replica's ranks and on an idle replica's PCP rank that owns no decode, at the first draft after
a decode step. At DP=1 the reuse is never checked, so PCP alone runs.

The count the draft's DP sync must be taken over is the batch each draft pass runs: the
PCP-local draft prefill padded to the replica's dispatch count on a busy replica (the same on
its PCP ranks), the dummy's own batch on an idle one (its draft runs the unpartitioned dummy),
and for K > 1 the draft decode's request count (replicated on every PCP rank). vLLM takes
exactly those when the speculator is given no agreement to reuse: both callers (`sample_tokens`
on a busy replica, `_dummy_run` on an idle one) call `propose` once per step, so every replica
then joins one DRAFT_PREFILL agreement per step (and one DRAFT_DECODE when K > 1), with the
same phases; under FSMWorker the agreement rows ride in those syncs like the target's.

`install` does that on the speculator instance (`propose` called with `dp_sync_state=None`),
only under DP x PCP, and only where the installed vLLM is one whose path is known to fail: a
release in `VERIFIED` (the reproduction in docs/vllm-mtp-pcp-dp.md ran on it, with and without
the fix) whose functions that make the defect have the source digests pinned for it. Anything
else is left to vLLM, and the description says why (the worker puts it in the `job` record).

vLLM 0.33.0: its pins are re-derived from its released source (`propose`, `sample_tokens` and
`dispatch_cg_and_sync_dp` changed: the skip-drafts row, a dummy's request count capped by a reused
sync's, the KV connector's finalize order; the reuse check still asserts at
vllm/v1/worker/gpu/dp_utils.py:296-302), but no 0.33 runs on this project's machines,
so the reproduction has not run there: the fix stays off on 0.33, with a warning on stderr at
start-up, until it does (then add "0.33.0" to VERIFIED).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.runners.base import wrap_method
from runner_fsm.integrations.vllm.common.pinning import source_digest

SPECULATOR = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator.TargetDependentARSpeculator"
_SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator"
# release -> (module, qualified name) -> sha256 (first 16 hex) of the source in that release: the
# reuse in `propose`, the PCP-local draft prefill, the reuse check, and the two callers that hand
# the target's agreement to `propose` on busy and idle replicas alike.
PINNED: dict[str, dict[tuple[str, str], str]] = {
    "0.32.0": {
        (_SPECULATOR_MODULE, "TargetDependentARSpeculator.propose"): "55c66c96992f7eca",
        ("vllm.v1.worker.gpu.pcp_manager", "PCPManager.prepare_draft_prefill"): "e3c5ce84373eebaf",
        ("vllm.v1.worker.gpu.dp_utils", "dispatch_cg_and_sync_dp"): "7b73eb8cd9b2852d",
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"): "de7f3c7b008b9c17",
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_run"): "82cd9936a8321745",
    },
    "0.33.0": {  # from the vllm-0.33.0 wheel's source (`runner-fsm vllm-check --source`)
        (_SPECULATOR_MODULE, "TargetDependentARSpeculator.propose"): "7e919b6a89f0ae05",
        ("vllm.v1.worker.gpu.pcp_manager", "PCPManager.prepare_draft_prefill"): "e3c5ce84373eebaf",
        ("vllm.v1.worker.gpu.dp_utils", "dispatch_cg_and_sync_dp"): "d8a28dfab9d89cf8",
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"): "82f16d6b90bdc243",
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner._dummy_run"): "82cd9936a8321745",
    },
}
# Releases on which the reproduction ran (the defect seen without the fix, gone with it).
VERIFIED = ("0.32.0",)
ACTION = ("speculator.propose runs with dp_sync_state=None: vLLM takes the draft's own DP sync over the batch"
          " each draft pass runs (DRAFT_PREFILL: the PCP-local draft prefill, or an idle replica's dummy;"
          " DRAFT_DECODE when K > 1), on every replica")
_MARK = "_runner_fsm_draft_dp_sync"


def pinned_problems(version: str) -> list[str]:
    """What differs from the vLLM whose draft path is known to fail (empty: the same)."""
    import importlib

    rel = versions.release(version)
    if rel not in PINNED:
        return [f"vLLM {version}: no pins for this release (pinned: {', '.join(PINNED)})"]
    problems = []
    for (module_name, qualname), digest in PINNED[rel].items():
        obj: Any = importlib.import_module(module_name)
        try:
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            problems.append(f"{module_name}.{qualname} is missing")
            continue
        found = source_digest(obj)
        if found != digest:
            problems.append(f"{qualname}: source digest {found}, pinned {digest}")
    return problems


def install(speculator: Any, *, dp_size: int, pcp_size: int, version: str) -> dict[str, Any]:
    """Make `speculator` take its own DP syncs where vLLM's reuse is known to fail; returns what
    was done (``installed``, and ``action`` or ``reason``) for the log's first record."""
    if dp_size <= 1 or pcp_size <= 1:
        return {"installed": False, "reason": f"DP={dp_size} x PCP={pcp_size}: vLLM's reuse of the target's"
                                              " DP sync fails only under DP x PCP"}
    cls = type(speculator)
    names = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
    if SPECULATOR not in names:
        return {"installed": False, "reason": f"{cls.__module__}.{cls.__qualname__} is not a"
                                              f" {SPECULATOR.rsplit('.', 1)[1]}: left to vLLM"}
    base = next(c for c in cls.__mro__ if f"{c.__module__}.{c.__qualname__}" == SPECULATOR)
    if inspect.getattr_static(cls, "propose") is not base.__dict__["propose"]:
        return {"installed": False, "reason": f"{cls.__qualname__} overrides propose: left to vLLM"}
    problems = pinned_problems(version)
    if problems:
        return {"installed": False, "reason": "not the vLLM whose draft path is known to fail here ("
                                              + "; ".join(problems) + "): left to vLLM"}
    if versions.release(version) not in VERIFIED:
        reason = (f"vLLM {version} matches its pins, but the reproduction (docs/vllm-mtp-pcp-dp.md) has not"
                  f" run on it (verified: {', '.join(VERIFIED)}): left to vLLM, whose reuse of the target's DP"
                  " sync may assert 'reusing a DP sync taken over a different batch' under MTP x PCP x DP")
        _warn_once(f"runner_fsm: draft_dp_sync is off: {reason}")
        return {"installed": False, "reason": reason}
    if not getattr(speculator, _MARK, False):
        index = list(inspect.signature(base.propose).parameters).index("dp_sync_state") - 1  # after self

        def own_sync(propose, args, kwargs):
            if len(args) > index:
                args = (*args[:index], None, *args[index + 1:])
            else:
                kwargs["dp_sync_state"] = None
            return propose(*args, **kwargs)
        wrap_method(speculator, "propose", own_sync)
        setattr(speculator, _MARK, True)
    return {"installed": True, "action": ACTION, "vllm": version,
            "pinned": {qualname: digest for (_, qualname), digest in PINNED[versions.release(version)].items()}}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """On stderr at start-up, once a process (each worker installs it)."""
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)
