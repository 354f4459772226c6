"""`fast_pcp_layout`: vLLM MRV2's PCP layout computed by `runner_fsm.pcp.layout`, opt-in.

MRV2's `PCPManager._build_batch_layout` and `get_num_tokens_for_dispatch` plan every step
in per-request Python (one loop per rank over every request, one `np.arange` per
segment). `install_fast_pcp_layout` replaces both, on a `PCPManager` class or instance,
with the vectorised ``mrv2`` policy of `runner_fsm.pcp.plan`, which `tests/test_pcp_layout_vllm.py`
holds equal to vLLM's own on thousands of random batches. It installs only where the
installed vLLM is that layout: the version the test pinned, the methods' signatures and
the digest of their source; anything else is left as vLLM wrote it, and the returned
description says why (the worker records it in the log's first record).

At call time the vectorised layout also steps aside, to vLLM's own method, for what it was
not pinned on: a manager whose `shard_decode_requests` is not vLLM's rule (`dcp == 1`), or a
`query_start_loc_np` that is not the running sum of the scheduled tokens.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.integrations.vllm.pinning import source_digest
from runner_fsm.pcp import layout, rows
from runner_fsm.pcp.plan import _validate, num_tokens_for_dispatch

PINNED_VERSION = "0.32.0"
MODULE = "vllm.v1.worker.gpu.pcp_manager"

# The layout's methods, their signatures and the sha256 (first 16 hex) of their source as
# in vLLM 0.32.0, which the property test compares against.
PINNED: dict[str, tuple[str, str]] = {
    "_build_batch_layout": (
        "(self, num_scheduled_tokens: numpy.ndarray, num_computed_tokens: numpy.ndarray,"
        " is_prefilling: numpy.ndarray, query_start_loc_np: numpy.ndarray,"
        " padded_num_tokens: int | None = None) -> tuple[list[list[vllm.v1.worker.gpu.pcp_manager.RankSegment]],"
        " list[int]]", "19404ed764bc19ae"),
    "get_num_tokens_for_dispatch": (
        "(self, num_scheduled_tokens: numpy.ndarray, is_prefilling: numpy.ndarray) -> int", "c7c65e30262f3b9d"),
    "_iter_rank_chunks": (
        "(self, rank: int, num_scheduled_tokens: numpy.ndarray, is_prefilling: numpy.ndarray)"
        " -> collections.abc.Iterator[tuple[int, int, int]]", "858aaf1b3ca2875c"),
    "_get_rank_segments": (
        "(self, rank: int, num_scheduled_tokens: numpy.ndarray, is_prefilling: numpy.ndarray,"
        " query_start_loc_np: numpy.ndarray) -> list[vllm.v1.worker.gpu.pcp_manager.RankSegment]", "ab000c27ff032361"),
    "_reorder_segments": (
        "(segments: list[vllm.v1.worker.gpu.pcp_manager.RankSegment], is_prefilling: numpy.ndarray)"
        " -> list[vllm.v1.worker.gpu.pcp_manager.RankSegment]", "6b41f9222d6ab6a9"),
    "replicated_requests": (
        "(self, num_scheduled_tokens: numpy.ndarray, is_prefilling: numpy.ndarray) -> numpy.ndarray", "0082bcf20f8b32f4"),
}
SEGMENT_FIELDS = ("global_batch_req_idx", "global_batch_slice", "rank_local_batch_slice")
INSTANCE_ATTRS = ("pcp_world_size", "shard_decode_requests", "dcp_world_size", "device")
_MARK = "_runner_fsm_fast_pcp_layout"


def schema_problems(manager_cls: type, version: str) -> list[str]:
    """What differs from the layout the property test pinned (empty: the same)."""
    import dataclasses

    from vllm.v1.worker.gpu import pcp_manager

    problems = [] if version == PINNED_VERSION else [f"vLLM {version}, pinned {PINNED_VERSION}"]
    for name, (signature, digest) in PINNED.items():
        method = inspect.getattr_static(manager_cls, name, None)
        if method is None:
            problems.append(f"PCPManager.{name} is missing")
            continue
        function = method.__func__ if isinstance(method, (staticmethod, classmethod)) else method
        if getattr(function, _MARK, False):
            function = getattr(manager_cls, f"{_MARK}_original_{name}")
        if str(inspect.signature(function)) != signature:
            problems.append(f"PCPManager.{name}{inspect.signature(function)}, pinned {signature}")
        elif digest and source_digest(function) != digest:
            problems.append(f"PCPManager.{name}: source digest {source_digest(function)}, pinned {digest}")
    segment = getattr(pcp_manager, "RankSegment", None)
    fields = tuple(f.name for f in dataclasses.fields(segment)) if dataclasses.is_dataclass(segment) else ()
    if fields != SEGMENT_FIELDS:
        problems.append(f"RankSegment fields {fields}, pinned {SEGMENT_FIELDS}")
    return problems


def install_fast_pcp_layout(target: Any) -> dict[str, Any]:
    """Install on a `PCPManager` subclass or instance; return what was done, and why not.

    The description's keys: ``installed`` (bool), ``target``, ``vllm``, ``methods`` and,
    when not installed, ``reason``. Installing twice is a no-op that says so.
    """
    import vllm
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    is_class = isinstance(target, type)
    cls = target if is_class else type(target)
    description = {"installed": False, "target": f"{cls.__module__}.{cls.__qualname__}" + ("" if is_class else " instance"),
                   "vllm": vllm.__version__, "methods": ["_build_batch_layout", "get_num_tokens_for_dispatch"],
                   "policy": "runner_fsm.pcp.plan chunking='mrv2'"}
    if not issubclass(cls, PCPManager):
        return {**description, "reason": f"{cls.__qualname__} is not a vLLM PCPManager"}
    if getattr(target, _MARK, False):
        return {**description, "installed": True, "reason": "already installed"}
    problems = schema_problems(cls, vllm.__version__)
    if not is_class:
        problems += [f"instance lacks {a}" for a in INSTANCE_ATTRS if not hasattr(target, a)]
    if problems:
        return {**description, "reason": "; ".join(problems)}
    if is_class:
        for name in ("_build_batch_layout", "get_num_tokens_for_dispatch"):
            setattr(cls, f"{_MARK}_original_{name}", cls.__dict__.get(name, getattr(cls, name)))
        cls._build_batch_layout = _build_batch_layout
        cls.get_num_tokens_for_dispatch = _get_num_tokens_for_dispatch
    else:
        for name in ("_build_batch_layout", "get_num_tokens_for_dispatch"):
            setattr(target, f"{_MARK}_original_{name}", getattr(target, name))
        target._build_batch_layout = types.MethodType(_build_batch_layout, target)
        target.get_num_tokens_for_dispatch = types.MethodType(_get_num_tokens_for_dispatch, target)
    setattr(target, _MARK, True)
    return {**description, "installed": True}


def _original(manager: Any, name: str):
    method = getattr(manager, f"{_MARK}_original_{name}")
    return method if isinstance(method, types.MethodType) else types.MethodType(method, manager)


def _pinned_config(manager: Any) -> bool:
    """vLLM shards decodes exactly when DCP is off; the layout was pinned on that rule."""
    return bool(manager.shard_decode_requests) == (manager.dcp_world_size == 1)


def _batch(manager: Any, num_scheduled: Any, is_prefilling: Any):
    return _validate(num_scheduled, is_prefilling, None, manager.pcp_world_size, "mrv2", None)


def _get_num_tokens_for_dispatch(self, num_scheduled_tokens, is_prefilling) -> int:
    if not _pinned_config(self):
        return _original(self, "get_num_tokens_for_dispatch")(num_scheduled_tokens, is_prefilling)
    try:
        return num_tokens_for_dispatch(num_scheduled_tokens, is_prefilling, self.pcp_world_size,
                                       chunking="mrv2", dcp_size=self.dcp_world_size)
    except BatchError:
        return _original(self, "get_num_tokens_for_dispatch")(num_scheduled_tokens, is_prefilling)


def _build_batch_layout(self, num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np,
                        padded_num_tokens=None):
    args = (num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np, padded_num_tokens)
    if not _pinned_config(self):
        return _original(self, "_build_batch_layout")(*args)
    try:
        batch = _batch(self, num_scheduled_tokens, is_prefilling)
    except BatchError:
        return _original(self, "_build_batch_layout")(*args)
    starts = np.asarray(query_start_loc_np)
    num_reqs, total = batch.num_scheduled.size, int(batch.num_scheduled.sum())
    req_start = np.cumsum(batch.num_scheduled) - batch.num_scheduled
    if (starts.ndim != 1 or starts.size < num_reqs + 1 or int(starts[-1]) != total
            or not np.array_equal(starts[:num_reqs], req_start) or int(starts[num_reqs]) != total):
        return _original(self, "_build_batch_layout")(*args)
    segs, shared = layout.plan_segments(batch.num_scheduled, batch.is_prefilling, batch.num_computed,
                                        self.pcp_world_size, "mrv2", self.dcp_world_size)
    per_rank = segs.tokens_per_rank.tolist()
    widest = max(per_rank)
    if padded_num_tokens is None:
        padded_num_tokens = widest
    elif padded_num_tokens < widest:
        raise ValueError(
            "PCP padded token count is smaller than the largest rank-local "
            f"batch: {padded_num_tokens} < {widest}."
        )
    # Fresh arrays, not a workspace: on a CPU device vLLM's tensors below alias them.
    gathered, write_mask, restore = rows.gathered_layout(segs, shared, req_start, total, padded_num_tokens)
    from vllm.utils.torch_utils import async_tensor_h2d

    self._hidden_restore_idx = async_tensor_h2d(restore, device=self.device)
    self._padded_gather_idx = async_tensor_h2d(gathered.reshape(-1), device=self.device)
    self._gathered_kv_write_mask = async_tensor_h2d(write_mask.reshape(-1), device=self.device)
    return SegmentsByRank(segs, req_start), per_rank


class SegmentsByRank(Sequence):
    """vLLM's `segments_by_rank`, each rank's list of `RankSegment` built when first read
    (MRV2 reads only its own rank's): per-segment objects only for the rank that needs them."""

    def __init__(self, segs: layout.Segments, req_start: np.ndarray):
        self._segs, self._req_start = segs, req_start
        self._bounds = np.concatenate([[0], np.cumsum(segs.per_rank)]).tolist()
        self._built: dict[int, list] = {}

    def __len__(self) -> int:
        return self._segs.per_rank.size

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        rank = range(len(self))[rank]
        if rank not in self._built:
            self._built[rank] = self._build(rank)
        return self._built[rank]

    def _build(self, rank: int) -> list:
        from vllm.v1.worker.gpu.pcp_manager import RankSegment

        lo, hi = self._bounds[rank], self._bounds[rank + 1]
        req, length = self._segs.req[lo:hi], self._segs.length[lo:hi]
        start = self._req_start[req] + self._segs.offset[lo:hi]
        local_end = np.cumsum(length)
        return [
            RankSegment(global_batch_req_idx=i, global_batch_slice=slice(a, a + n),
                        rank_local_batch_slice=slice(e - n, e))
            for i, a, n, e in zip(req.tolist(), start.tolist(), length.tolist(), local_end.tolist())
        ]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            list(a) == list(b) for a, b in zip(self, other))

    __hash__ = None
