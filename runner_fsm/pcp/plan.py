"""The PCP plan: how one replica's global batch is cut into rank-local batches.

DESIGN.md section 3 is the contract. Prefill requests are cut into ``C = 2P`` chunks and
rank ``r`` takes chunk ``r`` (head) and chunk ``C-1-r`` (tail); decode requests (including
verify rows of ``1+K`` tokens) are replicated on every rank. A third policy, ``mrv2``,
is vLLM Model Runner V2's layout (``PCPManager._build_batch_layout``). The mechanics, with
no Python loop over requests or tokens, are in `runner_fsm.pcp.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.pcp import layout, native, rows
from runner_fsm.pcp.arrays import ArrayLike, int_array
from runner_fsm.pcp.rows import PlanWorkspace


@dataclasses.dataclass(frozen=True, eq=False)
class RankBatch:
    """The rows one PCP rank executes; identical on every rank that computes the plan.

    A plan's rank batches are made by `RankBatch.on_demand`: their arrays are built the
    first time one of them is read, because a PCP rank executes only its own rows and
    building every rank's would cost each rank P times the work. (The contract says
    ``ranks`` is a tuple of `RankBatch`, so the batches exist at once and fill themselves.)
    """

    token_idx: np.ndarray  # per row: global token index
    req_idx: np.ndarray  # per row: request index
    positions: np.ndarray  # per row: absolute position in its request
    query_start_loc: np.ndarray  # per segment, plus one: row offsets of segments
    seq_lens: np.ndarray  # per segment: causal key length (start + length)
    seg_req_idx: np.ndarray  # per segment: request index

    @classmethod
    def on_demand(cls, build) -> RankBatch:
        """A batch whose fields are ``build()``'s (a dict of them), called on first read."""
        batch = object.__new__(cls)
        object.__setattr__(batch, "_build", build)
        return batch

    def __getattr__(self, name: str):
        # Reached only for attributes not set yet: the fields of a batch made by `on_demand`.
        build = self.__dict__.get("_build")
        if build is None or name not in _RANK_FIELDS:
            raise AttributeError(name)
        for field, value in build().items():
            object.__setattr__(self, field, value)
        object.__delattr__(self, "_build")
        return self.__dict__[name]

    @property
    def num_tokens(self) -> int:
        return int(self.token_idx.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.seg_req_idx.shape[0])


_RANK_FIELDS = frozenset(f.name for f in dataclasses.fields(RankBatch))


def _rank_batches(segments_of: Callable[[], layout.Segments], gathered: np.ndarray,
                  num_computed: np.ndarray) -> tuple[RankBatch, ...]:
    def builder(rank: int):
        def build() -> dict[str, np.ndarray]:
            segs = segments_of()
            n_r = int(segs.tokens_per_rank[rank])
            return {"token_idx": gathered[rank, :n_r], **rows.rank_rows(segs, num_computed, rank)}
        return build

    return tuple(RankBatch.on_demand(builder(r)) for r in range(gathered.shape[0]))


@dataclasses.dataclass(frozen=True, eq=False)
class PCPPlan:
    """A replica's batch cut across its PCP ranks; identical on every PCP rank of it."""

    pcp_size: int
    per_rank_num_tokens: tuple[int, ...]
    num_tokens_padded: int  # N: rows every PCP rank executes
    padded_gather_idx: np.ndarray  # [P*N] global token of each gathered row (0 for padding)
    kv_write_mask: np.ndarray  # [P*N] rows whose K/V this step writes (each token once)
    hidden_restore_idx: np.ndarray  # [T] gathered row holding global token t
    ranks: tuple[RankBatch, ...]  # rank r's rows, built when first read
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    # (segments, shared), made on the first call and kept (the plan's ranks share it): by the
    # numpy layout at once, after the compiled layout on first use
    segments_of: Callable[[], tuple[layout.Segments, np.ndarray]] = dataclasses.field(repr=False)

    @property
    def segments(self) -> layout.Segments:
        """Every rank's segments (`layout.Segments`)."""
        return self.segments_of()[0]

    @property
    def shared(self) -> np.ndarray:
        """[R] bool: requests every rank holds whole."""
        return self.segments_of()[1]

    @property
    def num_tokens(self) -> int:
        """Global number of scheduled tokens T."""
        return int(self.hidden_restore_idx.shape[0])

    def rank_rows(self, rank: int) -> slice:
        """Rows of the gathered layout that belong to ``rank`` (its rows, then padding)."""
        n = self.num_tokens_padded
        return slice(rank * n, (rank + 1) * n)

    def replicated_rows(self, rank: int) -> np.ndarray:
        """[n_r] bool: rank `rank`'s rows whose global token every PCP rank holds."""
        return rows.replicated_rows(self.segments, self.shared, rank)

    def global_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(position, request) of every global token, in global order."""
        return rows.global_rows(self.num_scheduled, self.num_computed)


@dataclasses.dataclass(frozen=True)
class _Batch:
    num_scheduled: np.ndarray
    is_prefilling: np.ndarray
    num_computed: np.ndarray | None  # None for a dispatch count, which must not read it


def _validate(
    num_scheduled: ArrayLike,
    is_prefilling: ArrayLike,
    num_computed: ArrayLike | None,
    pcp_size: int,
    chunking: str,
    max_num_tokens: int | None,
) -> _Batch:
    if not isinstance(pcp_size, (int, np.integer)) or pcp_size < 1:
        raise BatchError(f"pcp_size must be an integer >= 1, got {pcp_size!r}")
    if int(pcp_size) > native.MAX_PCP:  # before any array is sized by it (or ctypes truncates it)
        raise BatchError(f"pcp_size must be at most {native.MAX_PCP}, got {pcp_size!r}")
    if chunking not in layout.POLICIES:
        raise BatchError(f"chunking must be one of {', '.join(layout.POLICIES)}, got {chunking!r}")
    scheduled = int_array("num_scheduled", num_scheduled)
    if type(is_prefilling) is np.ndarray and is_prefilling.dtype == np.bool_ and is_prefilling.ndim == 1:
        prefilling = is_prefilling  # already a bool vector (the per-step case)
    else:
        prefilling = int_array("is_prefilling", is_prefilling, allow_bool=True).astype(bool)
    computed = None if num_computed is None else int_array("num_computed", num_computed)
    if not (scheduled.shape == prefilling.shape == (scheduled.shape if computed is None else computed.shape)):
        raise BatchError(
            "num_scheduled, is_prefilling and num_computed must have one entry per request,"
            f" got lengths {scheduled.shape[0]}, {prefilling.shape[0]},"
            f" {scheduled.shape[0] if computed is None else computed.shape[0]}"
        )
    # One reduction per array: each numpy call of a step's plan counts (docs/vllm.md).
    fewest = scheduled.min() if scheduled.size else 0
    for name, arr, low in (("num_scheduled", scheduled, fewest),
                           ("num_computed", computed, computed.min() if computed is not None and computed.size else 0)):
        if low < 0:
            bad = np.flatnonzero(arr < 0)
            raise BatchError(f"{name} must be >= 0, got {arr[bad[0]]} for request {bad[0]}")
    # MRV2 skips a request with no tokens; the other policies call it a scheduler bug.
    if fewest == 0 and scheduled.size and chunking != "mrv2":
        empty = np.flatnonzero(scheduled == 0)
        if len(empty) != scheduled.size:
            kind = "prefill" if prefilling[empty[0]] else "decode"
            raise BatchError(
                f"request {empty[0]} ({kind}) has 0 scheduled tokens in a batch with real ones;"
                " every scheduled request needs >= 1 token"
            )
    if max_num_tokens is not None and (total := int(scheduled.sum())) > max_num_tokens:
        raise BatchError(
            f"batch schedules {total} tokens, more than the capacity max_num_tokens={max_num_tokens}"
        )
    return _Batch(scheduled, prefilling, computed)


def _use_native(chunking: str, dcp_size: int, wanted: bool | None) -> bool:
    """Whether this plan takes the compiled layout (`native`: the mrv2 layout with DCP 1)."""
    if wanted is False or chunking != "mrv2" or dcp_size != 1:
        return False
    if native.library() is not None:
        return True
    if wanted:
        raise BatchError(f"native=True, but the compiled layout is not available: {native.status()['reason']}")
    return False


def _dispatch_count(batch: _Batch, pcp_size: int, chunking: str, dcp_size: int, use_native: bool) -> int:
    """N = widest rank-local batch, computed without building the rows."""
    lengths, prefilling = batch.num_scheduled, batch.is_prefilling
    if use_native:
        return native.dispatch_count(lengths, prefilling, pcp_size)
    if chunking == "mrv2" and dcp_size == 1:
        tokens = layout.sharded_tokens_per_rank(lengths, prefilling, pcp_size)
        return int(tokens.max()) if lengths.size else 0
    if chunking == "mrv2":  # the mrv2 grid does not read num_computed
        grid = layout.segment_grid(lengths, prefilling, np.zeros_like(lengths), pcp_size, chunking, dcp_size)
        return int(grid.length.reshape(pcp_size, -1).sum(axis=1).max()) if lengths.size else 0
    decode_tokens = int(lengths[~prefilling].sum())
    prefill_lengths = lengths[prefilling]
    if pcp_size == 1 or prefill_lengths.size == 0:
        return decode_tokens + int(prefill_lengths.sum())
    if chunking == "balanced":  # meets its lower bound by construction
        return decode_tokens + -(-int(prefill_lengths.sum()) // pcp_size)
    return decode_tokens + int(layout.ceil_chunk_tokens(prefill_lengths, pcp_size).max())


def _check_dcp(dcp_size: int) -> None:
    if not isinstance(dcp_size, (int, np.integer)) or dcp_size < 1:
        raise BatchError(f"dcp_size must be an integer >= 1, got {dcp_size!r}")


def num_tokens_for_dispatch(
    num_scheduled: ArrayLike,
    is_prefilling: ArrayLike,
    pcp_size: int,
    *,
    chunking: str = "ceil",
    max_num_tokens: int | None = None,
    dcp_size: int = 1,
    native: bool | None = None,
) -> int:
    """Dispatch count N of a replica's batch: the widest rank-local batch.

    It never reads ``num_computed``: dispatch sizing must not depend on request state that
    may be stale. ``dcp_size`` matters to ``mrv2`` only, and ``native`` too (see `plan_batch`).
    """
    _check_dcp(dcp_size)
    batch = _validate(num_scheduled, is_prefilling, None, pcp_size, chunking, max_num_tokens)
    return _dispatch_count(batch, pcp_size, chunking, dcp_size, _use_native(chunking, dcp_size, native))


def plan_batch(
    num_scheduled: ArrayLike,
    is_prefilling: ArrayLike,
    num_computed: ArrayLike,
    pcp_size: int,
    *,
    padded_num_tokens: int | None = None,
    chunking: str = "ceil",
    max_num_tokens: int | None = None,
    dcp_size: int = 1,
    workspace: PlanWorkspace | None = None,
    native: bool | None = None,
) -> PCPPlan:
    """Cut a global batch into ``pcp_size`` rank-local batches (DESIGN.md section 3).

    ``chunking="mrv2"`` is vLLM MRV2's layout instead: prefills cut into ``ceil`` chunks;
    inside a rank decodes first, then prefills, each in request order; with ``dcp_size ==
    1`` every request that is not cut (decodes) runs on one rank only, the k-th such
    request with tokens on rank ``k mod P`` (vLLM's ``shard_decode_requests``), and with
    ``dcp_size > 1`` it is replicated, as is every prefill too short to fill all ``2P``
    chunks. Requests with 0 tokens are allowed there and get no rows.

    With a ``workspace`` (`PlanWorkspace`, kept by the caller from step to step) the plan's
    gathered layout, write mask and restore index are written into it, and are valid until
    the next plan is written there; without one they are fresh arrays. Each rank's own rows
    are built when ``plan.ranks[r]`` is first read, from the arrays given here: a caller does
    not change them while it uses the plan.

    ``mrv2`` with ``dcp_size == 1`` is written by the compiled layout (`runner_fsm.pcp.native`)
    where it is built, and by numpy where it is not; the arrays are the same. ``native=False``
    plans in numpy always; ``native=True`` refuses to plan without the compiled layout.
    """
    _check_dcp(dcp_size)
    batch = _validate(num_scheduled, is_prefilling, num_computed, pcp_size, chunking, max_num_tokens)
    _check_padding(padded_num_tokens, pcp_size)
    if batch.num_computed is None:  # positions from 0 (a batch of fresh prompts)
        batch = dataclasses.replace(batch, num_computed=np.zeros_like(batch.num_scheduled))
    if _use_native(chunking, dcp_size, native):
        return _native_plan(batch, pcp_size, padded_num_tokens, workspace)
    segs, shared = layout.plan_segments(batch.num_scheduled, batch.is_prefilling, batch.num_computed,
                                        pcp_size, chunking, dcp_size)
    counts = segs.tokens_per_rank
    n = _padded(counts, padded_num_tokens)
    ends = np.cumsum(batch.num_scheduled)
    total = int(ends[-1]) if ends.size else 0
    gathered, write_mask, restore = rows.gathered_layout(segs, shared, ends - batch.num_scheduled, total, n,
                                                         workspace)
    return _plan(batch, pcp_size, counts, n, gathered, write_mask, restore, lambda: (segs, shared))


def _check_padding(padded_num_tokens: int | None, pcp_size: int) -> None:
    """N is an integer >= 0, and P * N leaves int64 headroom (`native.MAX_SIZE`)."""
    if padded_num_tokens is None:
        return
    if isinstance(padded_num_tokens, bool) or not isinstance(padded_num_tokens, (int, np.integer)):
        raise BatchError(f"padded_num_tokens must be an integer, got {padded_num_tokens!r}")
    if int(padded_num_tokens) < 0:
        raise BatchError(f"padded_num_tokens must be >= 0, got {padded_num_tokens}")
    if int(pcp_size) * int(padded_num_tokens) > native.MAX_SIZE:
        raise BatchError(f"padded_num_tokens={padded_num_tokens} is too large: pcp_size * padded_num_tokens"
                         f" = {int(pcp_size) * int(padded_num_tokens)} passes 2**62")


def _padded(counts: np.ndarray, padded_num_tokens: int | None) -> int:
    widest = int(counts.max()) if counts.size else 0
    n = widest if padded_num_tokens is None else int(padded_num_tokens)
    if n < widest:
        raise BatchError(
            f"padded_num_tokens={padded_num_tokens} is below the widest rank-local batch"
            f" ({widest} tokens, per rank {counts.tolist()})"
        )
    return n


def _native_plan(batch: _Batch, pcp_size: int, padded_num_tokens: int | None,
                 workspace: PlanWorkspace | None) -> PCPPlan:
    """The mrv2 layout (DCP 1) written by the compiled layout; segments made on first use."""
    lengths, prefilling = batch.num_scheduled, batch.is_prefilling
    space = PlanWorkspace() if workspace is None else workspace
    padded = None if padded_num_tokens is None else int(padded_num_tokens)
    n, counts = native.plan_into(lengths, prefilling, pcp_size, padded, space)
    rows_per_rank = counts[:pcp_size]
    if n == native.PADDING_TOO_SMALL:
        _padded(rows_per_rank, padded_num_tokens)  # raises, naming the widest rank
    size, total = pcp_size * n, int(counts[pcp_size])
    ints, bools = space.buffers()
    gathered, restore = ints[:size].reshape(pcp_size, n), ints[size:size + total]
    write_mask = bools[:size].reshape(pcp_size, n)

    def segments_of() -> tuple[layout.Segments, np.ndarray]:
        return layout.plan_segments(lengths, prefilling, batch.num_computed, pcp_size, "mrv2", 1)
    return _plan(batch, pcp_size, rows_per_rank, n, gathered, write_mask, restore, segments_of)


def _plan(batch: _Batch, pcp_size: int, counts: np.ndarray, n: int, gathered: np.ndarray,
          write_mask: np.ndarray, restore: np.ndarray,
          segments_of: Callable[[], tuple[layout.Segments, np.ndarray]]) -> PCPPlan:
    once = functools.cache(segments_of)  # the plan and each of its ranks share one call
    return PCPPlan(
        pcp_size=pcp_size,
        per_rank_num_tokens=tuple(counts.tolist()),
        num_tokens_padded=n,
        padded_gather_idx=gathered.reshape(-1),
        kv_write_mask=write_mask.reshape(-1),
        hidden_restore_idx=restore,
        ranks=_rank_batches(lambda: once()[0], gathered, batch.num_computed),
        num_scheduled=batch.num_scheduled,
        num_computed=batch.num_computed,
        segments_of=once,
    )
