"""`fast_pcp_layout`: vLLM MRV2's PCP layout written by `runner_fsm.pcp`, opt-in.

MRV2's `PCPManager._build_batch_layout` and `get_num_tokens_for_dispatch` plan every step
in per-request Python (one loop per rank over every request, one `np.arange` per segment,
every rank's `RankSegment`s). `install_fast_pcp_layout` replaces both on one manager
INSTANCE, never on a class (vLLM's `PCPManager` is shared by every manager in the process),
with the ``mrv2`` policy of `runner_fsm.pcp.plan`. With DCP 1 (decodes sharded, the layout
vLLM uses) and the compiled layout loaded, `runner_fsm.pcp.native` writes it: the dispatch
count, the layout, and the segments of the manager's own rank only (another rank's when
read); otherwise numpy does. `tests/test_pcp_layout_vllm.py` holds both equal to vLLM's own on
thousands of random batches. It installs only where the installed vLLM is that layout: the
version the test pinned, the methods' signatures and the digest of their source (and of
`RankSegment`, whose instances are made here without its `__init__`, for speed); anything
else is left as vLLM wrote it, and the returned description says why (the worker records it
in the log's first record).

At call time it also steps aside, to vLLM's own method, for what it was not pinned on: a
manager whose `shard_decode_requests` is not vLLM's rule (`dcp == 1`), a
`query_start_loc_np` that is not the running sum of the scheduled tokens, or inputs the
layout refuses (`BatchError`).
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import numpy as np
import torch

from runner_fsm.errors import BatchError
from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.runners.pcp_segments import FIELDS, SegmentsByRank
from runner_fsm.integrations.vllm.common.pinning import source_digest
from runner_fsm.pcp import layout, native, rows
from runner_fsm.pcp.plan import _check_padding, _validate, num_tokens_for_dispatch

MODULE = "vllm.v1.worker.gpu.pcp_manager"

# The layout's methods, their signatures and the sha256 (first 16 hex) of their source as
# in vLLM 0.32.0, which the property test compares against.
_PINNED_0_32: dict[str, tuple[str, str]] = {
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
# release -> its pins. vLLM 0.33.0's six methods and `RankSegment` are byte-identical to 0.32.0's
# (their digests, read from the 0.33.0 wheel's source by `runner-fsm vllm-check`): the property
# test's verdict carries over, so the layout stays on there.
PINNED: dict[str, dict[str, tuple[str, str]]] = {"0.32.0": _PINNED_0_32, "0.33.0": _PINNED_0_32}
SEGMENT_FIELDS = FIELDS
SEGMENT_DIGEST = "9e08c4b26c3b2bb4"  # RankSegment's source: a frozen dataclass, no __post_init__, no slots
INSTANCE_ATTRS = ("pcp_world_size", "pcp_rank", "shard_decode_requests", "dcp_world_size", "device")
METHODS = ("_build_batch_layout", "get_num_tokens_for_dispatch")
# Every name read from the PCP manager and its module (tests/test_vllm_rooms.py).
MANAGER_NAMES = (*_PINNED_0_32, *INSTANCE_ATTRS, "RankSegment")
_MARK = "_runner_fsm_fast_pcp_layout"
_PLANNER = f"{_MARK}_planner"  # the manager's `native.Planner`, where the compiled layout writes


def schema_problems(manager_cls: type, version: str) -> list[str]:
    """What differs from the layout the property test pinned (empty: the same)."""
    import dataclasses

    from vllm.v1.worker.gpu import pcp_manager

    rel = versions.release(version)
    if rel not in PINNED:
        return [f"vLLM {version}: no pins for this release (pinned: {', '.join(PINNED)})"]
    problems = []
    for name, (signature, digest) in PINNED[rel].items():
        method = inspect.getattr_static(manager_cls, name, None)
        if method is None:
            problems.append(f"PCPManager.{name} is missing")
            continue
        function = method.__func__ if isinstance(method, (staticmethod, classmethod)) else method
        if str(inspect.signature(function)) != signature:
            problems.append(f"PCPManager.{name}{inspect.signature(function)}, pinned {signature}")
        elif digest and source_digest(function) != digest:
            problems.append(f"PCPManager.{name}: source digest {source_digest(function)}, pinned {digest}")
    segment = getattr(pcp_manager, "RankSegment", None)
    fields = tuple(f.name for f in dataclasses.fields(segment)) if dataclasses.is_dataclass(segment) else ()
    if fields != SEGMENT_FIELDS:
        problems.append(f"RankSegment fields {fields}, pinned {SEGMENT_FIELDS}")
    elif source_digest(segment) != SEGMENT_DIGEST:
        problems.append(f"RankSegment: source digest {source_digest(segment)}, pinned {SEGMENT_DIGEST}")
    return problems


def _writer(dcp_size: int) -> str:
    if dcp_size != 1:
        return f"numpy (DCP {dcp_size}: decodes replicated, which the compiled layout does not write)"
    status = native.status()
    return "compiled layout (runner_fsm.pcp.native)" if status["native"] else f"numpy ({status['reason']})"


def check_fast_pcp_layout(manager_cls: type, dcp_size: int = 1) -> dict[str, Any]:
    """What `install_fast_pcp_layout` will do on a manager of `manager_cls` (the class a runner
    builds its manager from, before it exists), installing nothing: see there."""
    import vllm
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    cls = manager_cls if isinstance(manager_cls, type) else type(manager_cls)
    description = {"installed": False, "target": f"{cls.__module__}.{cls.__qualname__} instance",
                   "vllm": vllm.__version__, "methods": list(METHODS),
                   "policy": "runner_fsm.pcp.plan chunking='mrv2'", "writer": _writer(dcp_size)}
    if not issubclass(cls, PCPManager):
        return {**description, "reason": f"{cls.__qualname__} is not a vLLM PCPManager"}
    problems = schema_problems(cls, vllm.__version__)
    return {**description, "reason": "; ".join(problems)} if problems else {**description, "installed": True}


def install_fast_pcp_layout(manager: Any) -> dict[str, Any]:
    """Install on one `PCPManager` instance; return what was done, and why not.

    The description's keys: ``installed`` (bool), ``target``, ``vllm``, ``methods``, ``policy``,
    ``writer`` and, when not installed, ``reason``. Installing twice is a no-op that says so;
    a class is refused (every manager of the process would get it).
    """
    if isinstance(manager, type):
        return {**check_fast_pcp_layout(manager), "installed": False,
                "target": f"{manager.__module__}.{manager.__qualname__}",
                "reason": "installs on a PCPManager instance only: a class is shared by every manager built from it"}
    description = check_fast_pcp_layout(manager, getattr(manager, "dcp_world_size", 1))
    if not description["installed"]:
        return description
    if manager.__dict__.get(_MARK):
        return {**description, "reason": "already installed"}
    missing = [f"instance lacks {a}" for a in INSTANCE_ATTRS if not hasattr(manager, a)]
    if missing:
        return {**description, "installed": False, "reason": "; ".join(missing)}
    if description["writer"].startswith("compiled"):
        setattr(manager, _PLANNER, native.Planner(manager.pcp_world_size))
    for name in METHODS:
        setattr(manager, f"{_MARK}_original_{name}", getattr(manager, name))
    manager._build_batch_layout = types.MethodType(_build_batch_layout, manager)
    manager.get_num_tokens_for_dispatch = types.MethodType(_get_num_tokens_for_dispatch, manager)
    setattr(manager, _MARK, True)
    return description


def _original(manager: Any, name: str) -> Callable:
    return getattr(manager, f"{_MARK}_original_{name}")


def _pinned_config(manager: Any) -> bool:
    """vLLM shards decodes exactly when DCP is off; the layout was pinned on that rule."""
    return bool(manager.shard_decode_requests) == (manager.dcp_world_size == 1)


def _get_num_tokens_for_dispatch(self, num_scheduled_tokens, is_prefilling) -> int:
    if _pinned_config(self):
        planner = self.__dict__.get(_PLANNER)
        try:
            if planner is not None:
                planner.load(num_scheduled_tokens, is_prefilling)
                return planner.dispatch_count()
            return num_tokens_for_dispatch(num_scheduled_tokens, is_prefilling, self.pcp_world_size,
                                           chunking="mrv2", dcp_size=self.dcp_world_size)
        except BatchError:
            pass
    return _original(self, "get_num_tokens_for_dispatch")(num_scheduled_tokens, is_prefilling)


class _StepAside(Exception):
    """The batch is not one the layout was pinned on: vLLM's own method lays it out."""


def _build_batch_layout(self, num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np,
                        padded_num_tokens=None):
    args = (num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np, padded_num_tokens)
    if _pinned_config(self):
        planner = self.__dict__.get(_PLANNER)
        try:
            if planner is not None:
                return _compiled_layout(self, planner, *args)
            return _numpy_layout(self, *args)
        except (BatchError, _StepAside):
            pass
    return _original(self, "_build_batch_layout")(*args)


def _is_running_sum(starts: Any, lengths: np.ndarray) -> bool:
    """Whether vLLM's `query_start_loc_np` starts each request where the one before ends (the
    layout was pinned on that); entries past the last request repeat the total."""
    num_reqs = lengths.size
    if type(starts) is not np.ndarray or starts.ndim != 1 or starts.size <= num_reqs or starts[0] != 0:
        return False
    ends = lengths.cumsum()
    return bool(starts[-1] == (ends[-1] if num_reqs else 0) and (starts[1:num_reqs + 1] == ends).all())


_h2d: Callable | None = None


def _to_device(array: np.ndarray, device: Any):
    """`array` as a tensor on `device`, as vLLM's `async_tensor_h2d` makes it; on a CPU device
    that is `torch.from_numpy(array)` (its copy to the device a no-op), taken directly: about
    1 us less a tensor. vLLM's function is looked up once: an import statement in the step's
    path costs about 5 us (it asks vLLM's `torch_utils` module `__getattr__` for `__path__`)."""
    global _h2d
    if getattr(device, "type", device) == "cpu":
        return torch.from_numpy(array)
    if _h2d is None:
        from vllm.utils.torch_utils import async_tensor_h2d

        _h2d = async_tensor_h2d
    return _h2d(array, device=device)


def _too_small(padded: int, widest: int) -> ValueError:
    return ValueError("PCP padded token count is smaller than the largest rank-local "
                      f"batch: {padded} < {widest}.")


def _compiled_layout(self, planner: native.Planner, num_scheduled, num_computed, is_prefilling, starts, padded):
    planner.load(num_scheduled, is_prefilling)
    if not planner.begins_each_request(starts):
        raise _StepAside
    # Views of the planner's workspaces, intact until the layout after next. vLLM's manager reads
    # a step's layout within that step (partition_batch, prepare_attn, the drafter's prefill,
    # restore_for_sampling) and builds the next step's after it; on a CPU device its tensors
    # alias these arrays (one step of slack), on an accelerator they are copies.
    n, per_rank, ints, mask = planner.plan(padded)
    if n == native.PADDING_TOO_SMALL:
        raise _too_small(padded, max(per_rank))
    size = self.pcp_world_size * n
    self._hidden_restore_idx = _to_device(ints[size:], device=self.device)
    self._padded_gather_idx = _to_device(ints[:size], device=self.device)
    self._gathered_kv_write_mask = _to_device(mask, device=self.device)
    batch = planner.batch()  # for another rank's segments, read later (vLLM reads only its own)
    segments = SegmentsByRank(self.pcp_world_size,
                              lambda rank: native.rank_segments(*batch, self.pcp_world_size, rank))
    segments.known(self.pcp_rank, planner.rank_segments(self.pcp_rank))
    return segments, per_rank


def _numpy_layout(self, num_scheduled, num_computed, is_prefilling, starts, padded):
    batch = _validate(num_scheduled, is_prefilling, None, self.pcp_world_size, "mrv2", None)
    _check_padding(padded, self.pcp_world_size)
    if not _is_running_sum(starts, batch.num_scheduled):
        raise _StepAside
    req_start = np.cumsum(batch.num_scheduled) - batch.num_scheduled
    segs, shared = layout.plan_segments(batch.num_scheduled, batch.is_prefilling, batch.num_computed,
                                        self.pcp_world_size, "mrv2", self.dcp_world_size)
    per_rank = segs.tokens_per_rank.tolist()
    widest = max(per_rank)
    if padded is None:
        padded = widest
    elif padded < widest:
        raise _too_small(padded, widest)
    # Fresh arrays, not a workspace: on a CPU device vLLM's tensors below alias them.
    gathered, write_mask, restore = rows.gathered_layout(segs, shared, req_start, int(starts[-1]), padded)
    self._hidden_restore_idx = _to_device(restore, device=self.device)
    self._padded_gather_idx = _to_device(gathered.reshape(-1), device=self.device)
    self._gathered_kv_write_mask = _to_device(write_mask.reshape(-1), device=self.device)
    bounds = np.concatenate([[0], np.cumsum(segs.per_rank)]).tolist()

    def columns(rank: int) -> list[list[int]]:
        lo, hi = bounds[rank], bounds[rank + 1]
        req, length = segs.req[lo:hi], segs.length[lo:hi]
        start, local_end = req_start[req] + segs.offset[lo:hi], np.cumsum(length)
        return [req.tolist(), start.tolist(), (start + length).tolist(), (local_end - length).tolist(),
                local_end.tolist()]
    return SegmentsByRank(self.pcp_world_size, columns), per_rank
