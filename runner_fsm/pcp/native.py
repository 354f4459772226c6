"""The compiled `mrv2` layout (decodes sharded, DCP 1): `_mrv2_layout.c`, loaded with ctypes.

`plan_batch(chunking="mrv2")` and `num_tokens_for_dispatch` use it when it is there and fall
back to numpy (`layout.sharded_segments` + `rows.gathered_layout`) when it is not; both give
the same arrays (tests/test_plan_native.py). It is a plain shared library with no Python
headers, built next to its source by `make venv` (the Makefile's `NATIVE` rule); a checkout
without it plans in numpy, and `status()` says why.

Why it exists: right after the engine's own work every numpy call starts from cold caches,
and the numpy layout makes about 125 of them plus two running sums over its outputs; the
compiled one makes one call that writes each output once (measured in docs/vllm.md).

`RUNNER_FSM_NATIVE=0` in the environment turns it off (read once, at the first plan).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from runner_fsm.pcp.rows import PlanWorkspace

ABI = 4  # MRV2_LAYOUT_ABI in _mrv2_layout.c
LIBRARY = Path(__file__).with_name("_mrv2_layout.so")
PADDING_TOO_SMALL, NEEDS_SPACE, BROKEN_PROMISE = -1, -2, -3  # mrv2_plan's answers besides N

_ptr, _int = ctypes.c_void_p, ctypes.c_int64
_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_loaded = False


def _load() -> ctypes.CDLL | None:
    global _lib, _why_not, _loaded
    _loaded = True
    if os.environ.get("RUNNER_FSM_NATIVE", "1") == "0":
        _why_not = "turned off by RUNNER_FSM_NATIVE=0"
        return None
    if not LIBRARY.exists():
        _why_not = f"{LIBRARY.name} is not built (make venv builds it with the C compiler)"
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError as error:
        _why_not = f"{LIBRARY.name} does not load: {error}"
        return None
    lib.mrv2_layout_abi.restype = _int
    if lib.mrv2_layout_abi() != ABI:
        _why_not = f"{LIBRARY.name} is ABI {lib.mrv2_layout_abi()}, this package wants {ABI}: rebuild it"
        return None
    lib.mrv2_dispatch_count.restype = _int
    lib.mrv2_dispatch_count.argtypes = [_ptr, _ptr, _int, _int]
    lib.mrv2_plan.restype = _int
    lib.mrv2_plan.argtypes = [_ptr, _ptr, _int, _int, _int, _ptr, _int, _ptr, _int, _ptr]
    _lib = lib
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (then `status()` says why)."""
    return _lib if _loaded else _load()


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled PCP layout is not available: {_why_not}")
    return lib


def status() -> dict:
    """For logs and benchmarks: whether plans use the compiled layout, and if not, why."""
    lib = library()
    return {"native": lib is not None, **({} if lib is not None else {"reason": _why_not})}


def _inputs(lengths: np.ndarray, prefilling: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the C code reads: contiguous int64 lengths and one byte per prefilling flag."""
    if lengths.dtype != np.int64 or prefilling.dtype != np.bool_ or lengths.shape != prefilling.shape:
        raise TypeError(f"lengths int64 and prefilling bool of one shape, got {lengths.dtype} {lengths.shape}"
                        f" and {prefilling.dtype} {prefilling.shape}")
    return np.ascontiguousarray(lengths), np.ascontiguousarray(prefilling)


def dispatch_count(lengths: np.ndarray, prefilling: np.ndarray, pcp_size: int) -> int:
    """The widest rank's rows (MRV2's dispatch count). `lengths`: int64 [R], each >= 0
    (checked by the caller); `prefilling`: bool [R]."""
    lengths, prefilling = _inputs(lengths, prefilling)
    count = (_lib or _required()).mrv2_dispatch_count(lengths.ctypes.data, prefilling.ctypes.data,
                                                      lengths.size, pcp_size)
    if count < 0:
        raise MemoryError(f"no memory for the per-rank counts of {pcp_size} ranks")
    return count


def plan_into(lengths: np.ndarray, prefilling: np.ndarray, pcp_size: int, padded: int | None,
              workspace: PlanWorkspace) -> tuple[int, np.ndarray]:
    """Write one step's plan into `workspace`: (N, counts), counts holding the rows of each rank
    and then T. N is `padded`, or the widest rank's rows when `padded` is None; it is
    `PADDING_TOO_SMALL` (nothing written) when `padded` is below the widest rank's rows.
    In the workspace's buffers: the gathered layout (``[:P * N]``), then the restore index
    (``[P * N:P * N + T]``), and the write mask (``[:P * N]`` of the bools)."""
    lib = _lib or _required()
    lengths, prefilling = _inputs(lengths, prefilling)
    if padded is not None and padded < 0:
        raise ValueError(f"padded must be None or >= 0, got {padded}")
    workspace.reserve(0, 0, 3 * pcp_size + 1)  # rows of each rank, T, then 2P cursors
    args = (lengths.ctypes.data, prefilling.ctypes.data, lengths.size, pcp_size, -1 if padded is None else padded)
    while True:
        ints, bools = workspace.buffers()
        at_ints, at_bools, at_scratch = workspace.addresses
        n = lib.mrv2_plan(*args, at_ints, ints.size, at_bools, bools.size, at_scratch)
        if n != NEEDS_SPACE:
            break
        counts = workspace.scratch
        size = pcp_size * (int(counts[:pcp_size].max()) if padded is None else padded)
        workspace.reserve(size + int(counts[pcp_size]), size)
    if n == BROKEN_PROMISE:  # the layout's own count and its writer disagree: a bug here
        raise RuntimeError("the compiled PCP layout's writer disagrees with its own row count (a bug);"
                           " it stopped before writing outside its buffers")
    return n, workspace.scratch[:pcp_size + 1]
