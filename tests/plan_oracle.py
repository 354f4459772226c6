"""Test oracle: `runner_fsm.pcp.plan` as it was before the memory-limit rewrite (issue 17).

A verbatim copy of the planner's algorithm (commit 8c2c074; only the public names renamed,
the rank batch class imported, and the plan's class kept here as it was then), kept so that
the rewrite can be held byte for byte to it on random batches. Production code never imports this.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.pcp.arrays import ArrayLike, int_array
from runner_fsm.pcp.plan import RankBatch


@dataclasses.dataclass(frozen=True, eq=False)
class PCPPlan:
    """The plan as it was then: every rank's rows built at once (today's builds them on demand)."""

    pcp_size: int
    per_rank_num_tokens: tuple[int, ...]
    num_tokens_padded: int
    padded_gather_idx: np.ndarray
    kv_write_mask: np.ndarray
    hidden_restore_idx: np.ndarray
    ranks: tuple[RankBatch, ...]


@dataclasses.dataclass(frozen=True)
class _Batch:
    num_scheduled: np.ndarray
    is_prefilling: np.ndarray
    num_computed: np.ndarray


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
    if chunking not in ("ceil", "balanced"):
        raise BatchError(f"chunking must be 'ceil' or 'balanced', got {chunking!r}")
    scheduled = int_array("num_scheduled", num_scheduled)
    if type(is_prefilling) is np.ndarray and is_prefilling.dtype == np.bool_ and is_prefilling.ndim == 1:
        prefilling = is_prefilling  # already a bool vector (the per-step case)
    else:
        prefilling = int_array("is_prefilling", is_prefilling, allow_bool=True).astype(bool)
    computed = (
        np.zeros_like(scheduled) if num_computed is None else int_array("num_computed", num_computed)
    )
    if not (scheduled.shape == prefilling.shape == computed.shape):
        raise BatchError(
            "num_scheduled, is_prefilling and num_computed must have one entry per request,"
            f" got lengths {scheduled.shape[0]}, {prefilling.shape[0]}, {computed.shape[0]}"
        )
    for name, arr in (("num_scheduled", scheduled), ("num_computed", computed)):
        if arr.size and arr.min() < 0:
            bad = np.flatnonzero(arr < 0)
            raise BatchError(f"{name} must be >= 0, got {arr[bad[0]]} for request {bad[0]}")
    empty = np.flatnonzero(scheduled == 0) if scheduled.size and scheduled.min() == 0 else ()
    if len(empty) and len(empty) != scheduled.size:
        kind = "prefill" if prefilling[empty[0]] else "decode"
        raise BatchError(
            f"request {empty[0]} ({kind}) has 0 scheduled tokens in a batch with real ones;"
            " every scheduled request needs >= 1 token"
        )
    total = int(scheduled.sum())
    if max_num_tokens is not None and total > max_num_tokens:
        raise BatchError(
            f"batch schedules {total} tokens, more than the capacity max_num_tokens={max_num_tokens}"
        )
    return _Batch(scheduled, prefilling, computed)


def _dispatch_count(batch: _Batch, pcp_size: int, chunking: str) -> int:
    """N = widest rank-local batch, computed without building the plan."""
    lengths, prefilling = batch.num_scheduled, batch.is_prefilling
    decode_tokens = int(lengths[~prefilling].sum())
    prefill_lengths = lengths[prefilling]
    if pcp_size == 1 or prefill_lengths.size == 0:
        return decode_tokens + int(prefill_lengths.sum())
    if chunking == "balanced":  # meets its lower bound by construction
        return decode_tokens + -(-int(prefill_lengths.sum()) // pcp_size)
    sizes = _ceil_chunk_sizes(prefill_lengths, 2 * pcp_size)
    per_rank = sizes[:, :pcp_size] + sizes[:, ::-1][:, :pcp_size]
    return decode_tokens + int(per_rank.sum(axis=0).max())


def _ceil_chunk_sizes(lengths: np.ndarray, num_chunks: int) -> np.ndarray:
    """[R, C] chunk sizes: every chunk ceil(L/C) long, later ones short or empty."""
    chunk = -(-lengths // num_chunks)
    starts = np.arange(num_chunks)[None, :] * chunk[:, None]
    return np.clip(lengths[:, None] - starts, 0, chunk[:, None])


def _balanced_chunk_sizes(lengths: np.ndarray, pcp_size: int) -> np.ndarray:
    """[R, C] chunk sizes: floor(L/C) or one more, extras to the least-loaded ranks so far.

    Per request, extras go one at a time to the rank of least load (ties to the lower
    rank, at most one extra per chunk: head first, then tail). Loads stay within one of
    each other, so that greedy order has a closed form: the ranks at the low level
    ascending, then every rank ascending, then the ranks at the high level ascending.
    """
    num_chunks = 2 * pcp_size
    base = lengths // num_chunks
    sizes = np.repeat(base[:, None], num_chunks, axis=1)
    loads = [0] * pcp_size
    ranks = list(range(pcp_size))
    for i, extra in enumerate((lengths % num_chunks).tolist()):
        low = min(loads)
        order = [r for r in ranks if loads[r] == low] + ranks + [r for r in ranks if loads[r] > low]
        given = [0] * pcp_size
        for r in order[:extra]:
            sizes[i, r if given[r] == 0 else num_chunks - 1 - r] += 1
            given[r] += 1
        for r in ranks:
            loads[r] += given[r]
    return sizes


def oracle_num_tokens_for_dispatch(
    num_scheduled: ArrayLike,
    is_prefilling: ArrayLike,
    pcp_size: int,
    *,
    chunking: str = "ceil",
    max_num_tokens: int | None = None,
) -> int:
    """Dispatch count N of a replica's batch: the widest rank-local batch.

    It never reads ``num_computed``: dispatch sizing must not depend on request state that
    may be stale.
    """
    batch = _validate(num_scheduled, is_prefilling, None, pcp_size, chunking, max_num_tokens)
    return _dispatch_count(batch, pcp_size, chunking)


def oracle_plan_batch(
    num_scheduled: ArrayLike,
    is_prefilling: ArrayLike,
    num_computed: ArrayLike,
    pcp_size: int,
    *,
    padded_num_tokens: int | None = None,
    chunking: str = "ceil",
    max_num_tokens: int | None = None,
) -> PCPPlan:
    """Cut a global batch into ``pcp_size`` rank-local batches (DESIGN.md section 3)."""
    batch = _validate(num_scheduled, is_prefilling, num_computed, pcp_size, chunking, max_num_tokens)
    segs = _segments(batch, pcp_size, chunking)
    rows = _rows(segs, batch)
    counts = np.bincount(segs.rank, weights=segs.length, minlength=pcp_size).astype(np.int64)
    widest = int(counts.max()) if counts.size else 0
    n = widest if padded_num_tokens is None else int(padded_num_tokens)
    if n < widest:
        raise BatchError(
            f"padded_num_tokens={padded_num_tokens} is below the widest rank-local batch"
            f" ({widest} tokens, per rank {counts.tolist()})"
        )
    return _assemble(batch, segs, rows, counts, n, pcp_size)


@dataclasses.dataclass(frozen=True)
class _Segments:
    """All non-empty segments of all ranks, sorted by rank and then in-rank order."""

    rank: np.ndarray
    req: np.ndarray
    offset: np.ndarray  # first token's offset inside its request
    length: np.ndarray


def _segments(batch: _Batch, pcp_size: int, chunking: str) -> _Segments:
    lengths, prefilling = batch.num_scheduled, batch.is_prefilling
    num_chunks = 2 * pcp_size
    # With one rank there is nothing to cut: a prefill is one whole segment, like a decode.
    whole = ~prefilling if pcp_size > 1 else np.ones_like(prefilling)
    if whole.all():
        return _whole_segments(batch, pcp_size)
    return _cut_segments(batch, pcp_size, chunking, whole)


def _cut_segments(batch: _Batch, pcp_size: int, chunking: str, whole: np.ndarray) -> _Segments:
    """Whole segments for the requests marked `whole`, head and tail chunks for the others."""
    lengths, prefilling = batch.num_scheduled, batch.is_prefilling
    num_chunks = 2 * pcp_size
    decode_req = np.flatnonzero(whole)
    prefill_req = np.flatnonzero(~whole)
    ranks = np.arange(pcp_size)

    # Decode: one whole-request segment per rank (replicated).
    d_rank = np.repeat(ranks[None, :], decode_req.size, axis=0)
    d_req = np.repeat(decode_req[:, None], pcp_size, axis=1)
    d_off = np.zeros_like(d_rank)
    d_len = np.repeat(lengths[decode_req][:, None], pcp_size, axis=1)
    d_sub = np.zeros_like(d_rank)

    # Prefill: chunk r (head, sub 0) and chunk C-1-r (tail, sub 1) on rank r.
    p_len_all = lengths[prefill_req]
    if chunking == "ceil":
        sizes = _ceil_chunk_sizes(p_len_all, num_chunks)
    else:
        sizes = _balanced_chunk_sizes(p_len_all, pcp_size)
    starts = np.cumsum(sizes, axis=1) - sizes
    head, tail = ranks, num_chunks - 1 - ranks
    p_rank = np.concatenate([np.broadcast_to(ranks, sizes[:, head].shape)] * 2, axis=1)
    p_req = np.repeat(prefill_req[:, None], 2 * pcp_size, axis=1)
    p_off = np.concatenate([starts[:, head], starts[:, tail]], axis=1)
    p_len = np.concatenate([sizes[:, head], sizes[:, tail]], axis=1)
    p_sub = np.repeat([0, 1], pcp_size)[None, :].repeat(prefill_req.size, axis=0)

    rank = np.concatenate([d_rank.ravel(), p_rank.ravel()])
    req = np.concatenate([d_req.ravel(), p_req.ravel()])
    off = np.concatenate([d_off.ravel(), p_off.ravel()])
    length = np.concatenate([d_len.ravel(), p_len.ravel()])
    sub = np.concatenate([d_sub.ravel(), p_sub.ravel()])
    # Pure prefill: a prefill segment that starts at absolute position 0; it goes last.
    pure = prefilling[req] & (batch.num_computed[req] + off == 0)
    keep = length > 0
    order = np.lexsort((sub[keep], req[keep], pure[keep], rank[keep]))
    return _Segments(rank[keep][order], req[keep][order], off[keep][order], length[keep][order])


def _whole_segments(batch: _Batch, pcp_size: int) -> _Segments:
    """No request is cut (decodes only, or one rank): every rank holds every request whole,
    in request order with pure prefills last (the order `_segments` sorts into)."""
    lengths = batch.num_scheduled
    req = np.flatnonzero(lengths > 0)
    pure = batch.is_prefilling[req] & (batch.num_computed[req] == 0)
    if pure.any():
        req = np.concatenate([req[~pure], req[pure]])
    n, length = req.size, lengths[req]
    if pcp_size > 1:  # the same segments on every rank
        req, length = np.tile(req, pcp_size), np.tile(length, pcp_size)
    return _Segments(np.repeat(np.arange(pcp_size), n), req, np.zeros(n * pcp_size, dtype=np.int64), length)


@dataclasses.dataclass(frozen=True)
class _Rows:
    token: np.ndarray
    req: np.ndarray
    position: np.ndarray


def _rows(segs: _Segments, batch: _Batch) -> _Rows:
    """Expand segments into rows without a Python loop over tokens.

    Row k of segment s has offset ``off[s] + (k - first_row[s])`` in its request, so each
    per-row array is one ``arange`` plus a per-segment constant repeated over the segment.
    """
    req_start = np.cumsum(batch.num_scheduled) - batch.num_scheduled
    total = int(segs.length.sum())
    first_row = np.cumsum(segs.length) - segs.length
    row = np.arange(total, dtype=np.int64)
    shift = segs.offset - first_row
    token = row + np.repeat(req_start[segs.req] + shift, segs.length)
    position = row + np.repeat(batch.num_computed[segs.req] + shift, segs.length)
    return _Rows(token, np.repeat(segs.req, segs.length), position)


def _assemble(
    batch: _Batch, segs: _Segments, rows: _Rows, counts: np.ndarray, n: int, pcp_size: int
) -> PCPPlan:
    seg_counts = np.bincount(segs.rank, minlength=pcp_size)
    row_bounds = np.concatenate([[0], np.cumsum(counts)])
    seg_bounds = np.concatenate([[0], np.cumsum(seg_counts)])
    seq_lens_all = batch.num_computed[segs.req] + segs.offset + segs.length
    ranks = []
    for r in range(pcp_size):
        rs, ss = slice(row_bounds[r], row_bounds[r + 1]), slice(seg_bounds[r], seg_bounds[r + 1])
        qsl = np.concatenate([[0], np.cumsum(segs.length[ss])]).astype(np.int64)
        ranks.append(
            RankBatch(
                token_idx=rows.token[rs],
                req_idx=rows.req[rs],
                positions=rows.position[rs],
                query_start_loc=qsl,
                seq_lens=seq_lens_all[ss],
                seg_req_idx=segs.req[ss],
            )
        )

    # Rank r's rows are contiguous in the gathered layout: rows r*N .. r*N + n_r - 1.
    gather_idx = np.zeros(pcp_size * n, dtype=np.int64)
    write_mask = np.zeros(pcp_size * n, dtype=bool)
    restore = np.zeros(int(batch.num_scheduled.sum()), dtype=np.int64)
    for r, rank in enumerate(ranks):
        rows_r = slice(r * n, r * n + rank.num_tokens)
        gather_idx[rows_r] = rank.token_idx
        # Decode rows are replicated: only rank 0's copy writes K/V and restores hidden states.
        owned = np.ones(rank.num_tokens, bool) if r == 0 else batch.is_prefilling[rank.req_idx]
        write_mask[rows_r] = owned
        owned_rows = np.flatnonzero(owned)
        restore[rank.token_idx[owned_rows]] = r * n + owned_rows
    return PCPPlan(
        pcp_size=pcp_size,
        per_rank_num_tokens=tuple(int(c) for c in counts),
        num_tokens_padded=n,
        padded_gather_idx=gather_idx,
        kv_write_mask=write_mask,
        hidden_restore_idx=restore,
        ranks=tuple(ranks),
    )
