"""The compiled `mrv2` layout (decodes sharded, DCP 1): `_mrv2_layout.c`, loaded with ctypes.

`plan_batch(chunking="mrv2")` and `num_tokens_for_dispatch` use it when it is there and fall
back to numpy (`layout.sharded_segments` + `rows.gathered_layout`) when it is not; both give
the same arrays (tests/test_plan_native.py). It is a plain shared library with no Python
headers, built by the package's build where a C compiler is (setup.py: `pip install`, wheels,
sdists) and in place by `make` in a checkout; an installation without it plans in numpy, and
`status()` says why.

Why it exists: right after the engine's own work every numpy call starts from cold caches,
and the numpy layout makes about 125 of them plus two running sums over its outputs; the
compiled one makes one call that writes each output once (measured in docs/vllm.md).

The library is loaded once, under a lock, at the first plan. Any failure to load it (a file
that is no library, a missing function, a library built from other source than the
`_mrv2_layout.c` shipped beside it: its build stamps it with the start of that file's
sha256) leaves plans to numpy, with the reason. Every size reaches C checked here first
(ctypes truncates a Python int that does not fit, silently) and again there.
`RUNNER_FSM_NATIVE=0` in the environment turns it off (read once, at the first plan).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.pcp.rows import PlanWorkspace

SOURCE = Path(__file__).with_name("_mrv2_layout.c")
LIBRARY = SOURCE.with_suffix(".dll" if os.name == "nt" else ".so")
BUILD_ERROR = SOURCE.with_suffix(".build-error")  # left by setup.py where the build failed
# mrv2_plan's answers besides N (MRV2_ in _mrv2_layout.c)
PADDING_TOO_SMALL, NEEDS_SPACE, BROKEN_PROMISE, BAD_ARGUMENT, TOO_LARGE, NO_MEMORY = -1, -2, -3, -4, -5, -6
# The limits the C code enforces too: with T and P*N + T at most 2^62 and P at most 2^16, none
# of its sums or products can overflow int64.
MAX_PCP = 1 << 16
MAX_SIZE = 1 << 62

_ptr, _int = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "mrv2_dispatch_count": [_ptr, _ptr, _int, _int],
    "mrv2_plan": [_ptr, _ptr, _int, _int, _int, _ptr, _int, _ptr, _int, _ptr, _int],
    "mrv2_rank_segments": [_ptr, _ptr, _int, _int, _int, _ptr, _int],
    "mrv2_is_running_sum": [_ptr, _int, _ptr, _int],
}
_lock = threading.Lock()
_state: tuple[ctypes.CDLL | None, str | None] | None = None  # (library, why not), once loaded


def source_digest() -> str:
    """The stamp of a library built from `SOURCE` (setup.py and the Makefile compute it too)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _not_built() -> str:
    """Why the library is not there: the build's error where setup.py left one, else that it
    was never built."""
    try:
        failed = BUILD_ERROR.read_text().strip()
    except OSError:
        return (f"{LIBRARY.name} is not built (in a checkout `make` builds it;"
                " pip install builds it where a C compiler is)")
    return (f"{LIBRARY.name} was not built when this package was installed: {failed}."
            " Installing it where a C compiler is builds it")


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("RUNNER_FSM_NATIVE", "1") == "0":
        return None, "turned off by RUNNER_FSM_NATIVE=0"
    if not LIBRARY.exists():
        return None, _not_built()
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        lib.mrv2_layout_source_digest.restype = ctypes.c_char_p
        built_from = lib.mrv2_layout_source_digest().decode()
        for name, argtypes in SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = _int, argtypes
        shipped = source_digest()
    except Exception as error:  # whatever stops it loading (AttributeError: a function missing)
        return None, f"{LIBRARY.name} does not load: {type(error).__name__}: {error}"
    if built_from != shipped:
        return None, (f"{LIBRARY.name} was built from other source (sha256 {built_from}...) than the"
                      f" {SOURCE.name} beside it ({shipped}...): rebuild it")
    return lib, None


def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    global _state
    state = _state
    if state is None:
        with _lock:  # loaded once: a caller that comes meanwhile waits for the answer
            if _state is None:
                _state = _load()
            state = _state
    return state


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (then `status()` says why)."""
    return _loaded()[0]


def _required() -> ctypes.CDLL:
    lib, why_not = _loaded()
    if lib is None:
        raise RuntimeError(f"the compiled PCP layout is not available: {why_not}")
    return lib


def status() -> dict:
    """For logs and benchmarks: whether plans use the compiled layout, and if not, why."""
    lib, why_not = _loaded()
    return {"native": True} if lib is not None else {"native": False, "reason": why_not}


def _integer(name: str, value, low: int, high: int) -> int:
    """`value` as an int in [low, high], or a BatchError naming it (never a truncated int in C)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BatchError(f"{name} must be an integer, got {value!r}")
    number = int(value)  # exact for numpy's unsigned integers too
    if not low <= number <= high:
        raise BatchError(f"{name} must be in [{low}, {high}], got {number}")
    return number


def check_pcp(pcp_size) -> int:
    return _integer("pcp_size", pcp_size, 1, MAX_PCP)


def _padded(pcp_size: int, padded) -> int:
    """N as C takes it: -1 for "the widest rank's rows", else checked so that P*N fits."""
    if padded is None:
        return -1
    return _integer("padded_num_tokens", padded, 0, MAX_SIZE // pcp_size)


def _refused(code: int, pcp_size: int, padded: int) -> None:
    """Raise for an answer of the C code that is not N: it refused what it was given."""
    if code == BAD_ARGUMENT:
        raise BatchError("num_scheduled must be >= 0: the compiled layout found a negative length")
    if code == TOO_LARGE:
        raise BatchError(f"the batch is too large: T (the sum of num_scheduled) and pcp_size * N + T must be"
                         f" at most 2**62 (pcp_size={pcp_size}, padded_num_tokens={None if padded < 0 else padded})")
    if code == NO_MEMORY:
        raise MemoryError(f"no memory for the per-rank counts of {pcp_size} ranks")
    if code == BROKEN_PROMISE:  # the layout's own count and its writer disagree: a bug here
        raise RuntimeError("the compiled PCP layout's writer disagrees with its own row count (a bug);"
                           " it stopped before writing outside its buffers")


def _inputs(lengths: np.ndarray, prefilling: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the C code reads: contiguous int64 lengths and one byte per prefilling flag."""
    if lengths.dtype != np.int64 or prefilling.dtype != np.bool_ or lengths.shape != prefilling.shape:
        raise TypeError(f"lengths int64 and prefilling bool of one shape, got {lengths.dtype} {lengths.shape}"
                        f" and {prefilling.dtype} {prefilling.shape}")
    return np.ascontiguousarray(lengths), np.ascontiguousarray(prefilling)


def dispatch_count(lengths: np.ndarray, prefilling: np.ndarray, pcp_size: int) -> int:
    """The widest rank's rows (MRV2's dispatch count). `lengths`: int64 [R]; `prefilling`: bool [R]."""
    pcp_size = check_pcp(pcp_size)
    lengths, prefilling = _inputs(lengths, prefilling)
    count = _required().mrv2_dispatch_count(lengths.ctypes.data, prefilling.ctypes.data, lengths.size, pcp_size)
    _refused(count, pcp_size, -1)
    return count


def rank_segments(lengths: np.ndarray, prefilling: np.ndarray, pcp_size: int, rank: int) -> list[list[int]]:
    """Rank `rank`'s segments, in its order, as five lists: request, first and end global
    token, first and end row of the rank. `lengths`: int64 [R]; `prefilling`: bool [R]."""
    pcp_size = check_pcp(pcp_size)
    rank = _integer("rank", rank, 0, pcp_size - 1)
    lengths, prefilling = _inputs(lengths, prefilling)
    segments = np.empty((5, 2 * lengths.size), dtype=np.int64)  # at most 2 per request
    count = _required().mrv2_rank_segments(lengths.ctypes.data, prefilling.ctypes.data, lengths.size, pcp_size,
                                           rank, segments.ctypes.data, segments.shape[1])
    _refused(count, pcp_size, -1)
    return segments[:, :count].tolist()


def plan_into(lengths: np.ndarray, prefilling: np.ndarray, pcp_size: int, padded: int | None,
              workspace: PlanWorkspace) -> tuple[int, np.ndarray]:
    """Write one step's plan into `workspace`: (N, counts), counts holding the rows of each rank
    and then T. N is `padded`, or the widest rank's rows when `padded` is None; it is
    `PADDING_TOO_SMALL` (nothing written) when `padded` is below the widest rank's rows.
    In the workspace's buffers: the gathered layout (``[:P * N]``), then the restore index
    (``[P * N:P * N + T]``), and the write mask (``[:P * N]`` of the bools)."""
    lib = _required()
    pcp_size = check_pcp(pcp_size)
    lengths, prefilling = _inputs(lengths, prefilling)
    n_arg = _padded(pcp_size, padded)
    workspace.reserve(0, 0, 3 * pcp_size + 1)  # rows of each rank, T, then 2P cursors
    args = (lengths.ctypes.data, prefilling.ctypes.data, lengths.size, pcp_size, n_arg)
    n = _plan_with(lib, args, workspace)
    _refused(n, pcp_size, n_arg)
    return n, workspace.scratch[:pcp_size + 1]


def _plan_with(lib: ctypes.CDLL, args: tuple, workspace: PlanWorkspace) -> int:
    """`mrv2_plan` into `workspace`, grown and called again when its buffers are short: N, or
    the C code's answer. `args`: lengths, flags, R, P, N (the caller checked them)."""
    pcp = args[3]
    while True:
        ints, bools = workspace.buffers()
        at_ints, at_bools, at_scratch = workspace.addresses
        n = lib.mrv2_plan(*args, at_ints, ints.size, at_bools, bools.size, at_scratch, workspace.scratch.size)
        if n != NEEDS_SPACE:
            return n
        total, rows = int(workspace.scratch[pcp]), pcp * int(workspace.scratch[pcp + 1])
        workspace.reserve(rows + total, rows)


class Planner:
    """The compiled layout for a caller that plans step after step with one P (vLLM's PCP
    manager: `integrations/vllm/runners/pcp/layout.py`). Each batch is copied into memory kept from
    call to call, whose addresses are read once per growth (a read of numpy's `.ctypes.data`
    costs about 1.5 us, a copy of a few hundred lengths less). Plans are written into two
    `PlanWorkspace`s in turn: a plan stays intact while the next one is written, and is
    overwritten by the one after it. Fresh arrays each step would cost a page fault per 4 KiB
    written (rows.py), right after the engine's own work about as much as the whole layout."""

    def __init__(self, pcp_size: int):
        self.pcp_size = check_pcp(pcp_size)
        self._lib = _required()
        self._spaces = (PlanWorkspace(), PlanWorkspace())
        for space in self._spaces:
            space.reserve(0, 0, 3 * self.pcp_size + 1)  # rows of each rank, T, then 2P cursors
        self._turn = 0
        self.num_reqs = 0
        self._reserve(64)

    def _reserve(self, num_reqs: int) -> None:
        self._lengths = np.empty(num_reqs, dtype=np.int64)
        self._flags = np.empty(num_reqs, dtype=np.bool_)
        self._starts = np.empty(num_reqs + 1, dtype=np.int64)
        self._segments = np.empty((5, 2 * num_reqs), dtype=np.int64)  # at most 2 per request
        self._at = (self._lengths.ctypes.data, self._flags.ctypes.data)
        self._at_starts, self._at_segments = self._starts.ctypes.data, self._segments.ctypes.data

    def load(self, num_scheduled: np.ndarray, is_prefilling: np.ndarray) -> None:
        """Copy in the batch the calls below plan: integer lengths and bool flags, one per request."""
        if (type(num_scheduled) is not np.ndarray or type(is_prefilling) is not np.ndarray
                or num_scheduled.dtype.kind not in "iu" or is_prefilling.dtype != np.bool_
                or num_scheduled.ndim != 1 or num_scheduled.shape != is_prefilling.shape):
            raise BatchError("the compiled layout plans from a 1-D integer array of lengths and bool flags of one"
                             f" shape, got {type(num_scheduled).__name__} and {type(is_prefilling).__name__}")
        num_reqs = num_scheduled.size
        if num_reqs > self._lengths.size:
            self._reserve(num_reqs + num_reqs // 4)
        self._lengths[:num_reqs] = num_scheduled  # any length beyond int64 wraps negative: refused in C
        self._flags[:num_reqs] = is_prefilling
        self.num_reqs = num_reqs

    def begins_each_request(self, starts: np.ndarray) -> bool:
        """Whether `starts` (vLLM's `query_start_loc_np`) holds where each loaded request
        begins, then T, and T again in its last entry (entries past T are for padding)."""
        if type(starts) is not np.ndarray or starts.ndim != 1 or starts.dtype.kind not in "iu":
            return False
        size = starts.size
        if size > self._starts.size:
            self._starts = np.empty(size + size // 4, dtype=np.int64)
            self._at_starts = self._starts.ctypes.data
        self._starts[:size] = starts
        return self._lib.mrv2_is_running_sum(self._at[0], self.num_reqs, self._at_starts, size) == 1

    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the loaded lengths (int64) and flags, which later loads leave alone."""
        return self._lengths[:self.num_reqs].copy(), self._flags[:self.num_reqs].copy()

    def dispatch_count(self) -> int:
        count = self._lib.mrv2_dispatch_count(*self._at, self.num_reqs, self.pcp_size)
        _refused(count, self.pcp_size, -1)
        return count

    def plan(self, padded: int | None) -> tuple[int, list[int], np.ndarray, np.ndarray]:
        """(N, rows of each rank, ints, mask) of the loaded batch: ints holds the gathered layout
        ``[:P * N]`` and then the restore index ``[P * N:]``, views of this turn's workspace
        (valid until the plan after next); N is `PADDING_TOO_SMALL` (the arrays empty) when
        `padded` is below the widest rank's rows."""
        pcp = self.pcp_size
        n_arg = _padded(pcp, padded)
        space = self._spaces[self._turn]
        self._turn ^= 1
        n = _plan_with(self._lib, (*self._at, self.num_reqs, pcp, n_arg), space)
        counts = space.scratch
        if n < 0:
            if n != PADDING_TOO_SMALL:
                _refused(n, pcp, n_arg)
            return n, counts[:pcp].tolist(), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.bool_)
        ints, bools = space.buffers()
        size = pcp * n
        return n, counts[:pcp].tolist(), ints[:size + int(counts[pcp])], bools[:size]

    def rank_segments(self, rank: int) -> list[list[int]]:
        """Rank `rank`'s segments of the loaded batch, in its order, as five lists: request,
        first and end global token, first and end row of the rank."""
        rank = _integer("rank", rank, 0, self.pcp_size - 1)
        cap = self._segments.shape[1]
        count = self._lib.mrv2_rank_segments(*self._at, self.num_reqs, self.pcp_size, rank, self._at_segments, cap)
        _refused(count, self.pcp_size, -1)
        return self._segments[:, :count].tolist()
