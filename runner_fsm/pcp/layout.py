"""The PCP plan's segments: which piece of which request each rank computes, in its order,
with no per-request Python.

Every policy first says, for each rank ``r``, request ``i`` and side ``s`` (0: head, 1:
tail), the offset and length of the segment of request ``i`` that rank ``r`` computes: a
``[P, R, 2]`` grid (a request that is not cut is one head segment, on every rank or on its
one owner). A rank's segments are the non-empty cells of its plane in (request, side)
order, with the cells the policy marks ``late`` moved after the others, keeping their
order; one ``flatnonzero`` over the grid lists every rank's segments in that order.

vLLM MRV2's layout with sharded decodes (``mrv2``, DCP off: the layout vLLM uses and
`fast_pcp_layout` replaces) has its own, smaller table (`sharded_segments`): the grid is
``[P, R, 2]`` over every request, that one ``[P, D/P + 2 Rp]`` over the decodes dealt out and
the prefills' chunks. `runner_fsm.pcp.rows` then writes the plan's arrays from the segments.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

POLICIES = ("ceil", "balanced", "mrv2")


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where each rank's segment of each request lies: ``[P, R, 2]`` (rank, request, side)."""

    offset: np.ndarray  # first token's offset inside its request
    length: np.ndarray  # tokens; 0 where the rank computes nothing of that side
    late: np.ndarray  # bool: segments that go after the others of their rank, in order
    shared: np.ndarray  # [R] bool: requests every rank holds whole (rank 0's copy is owned)


def plan_segments(num_scheduled: np.ndarray, is_prefilling: np.ndarray, num_computed: np.ndarray,
                  pcp_size: int, policy: str, dcp_size: int = 1) -> tuple[Segments, np.ndarray]:
    """The segments of `policy`, and the requests every rank holds whole (``[R]`` bool)."""
    if policy == "mrv2" and dcp_size == 1:
        return (sharded_segments(num_scheduled, is_prefilling, pcp_size),
                np.zeros(num_scheduled.size, dtype=bool))
    grid = segment_grid(num_scheduled, is_prefilling, num_computed, pcp_size, policy, dcp_size)
    return segments(grid), grid.shared


def segment_grid(num_scheduled: np.ndarray, is_prefilling: np.ndarray, num_computed: np.ndarray,
                 pcp_size: int, policy: str, dcp_size: int = 1) -> Grid:
    """The grid of `policy` (see `plan.plan_batch` for what each policy does), for the
    layouts that replicate whole requests; ``mrv2`` with DCP off is `sharded_segments`."""
    lengths, num_chunks = num_scheduled, 2 * pcp_size
    if policy == "mrv2":
        if dcp_size == 1:
            raise ValueError("mrv2 with dcp_size 1 shards its decodes: use sharded_segments")
        # a prefill too short to fill every chunk is replicated instead
        cut = is_prefilling & ((num_chunks - 1) * -(-lengths // num_chunks) < lengths)
    else:  # one rank cuts nothing; more ranks cut every prefill
        cut = is_prefilling if pcp_size > 1 else np.zeros_like(is_prefilling)
    length = np.zeros((pcp_size, lengths.size, 2), dtype=np.int64)
    length[:, :, 0] = lengths  # every request whole as a head segment on every rank
    offset = np.zeros_like(length)
    if cut.any():
        cut_offset, cut_length = (_balanced_grid(lengths, cut, pcp_size) if policy == "balanced"
                                  else _ceil_grid(lengths, pcp_size))
        if cut.all():
            offset, length = cut_offset, cut_length
        else:
            cut3 = cut[:, None]
            offset, length = np.where(cut3, cut_offset, offset), np.where(cut3, cut_length, length)
    nonempty = length > 0
    if policy == "mrv2":  # decodes first, then prefills, each in request order
        late = nonempty & is_prefilling[:, None]
    else:  # pure prefill (starting at absolute position 0) last
        late = nonempty & is_prefilling[:, None] & (num_computed[:, None] + offset == 0)
    return Grid(offset, length, late, ~cut)


@functools.lru_cache(maxsize=64)
def _chunk_index(pcp_size: int) -> np.ndarray:
    """[P, 1, 2]: rank r's head chunk r and tail chunk 2P-1-r (read-only, shared)."""
    ranks = np.arange(pcp_size)
    index = np.stack([ranks, 2 * pcp_size - 1 - ranks], axis=1)[:, None, :]
    index.flags.writeable = False
    return index


@functools.lru_cache(maxsize=64)
def _chunks(pcp_size: int) -> np.ndarray:
    """[2P]: 0, 1, ..., 2P-1 (read-only, shared)."""
    chunks = np.arange(2 * pcp_size)
    chunks.flags.writeable = False
    return chunks


def _ceil_grid(lengths: np.ndarray, pcp_size: int):
    """Chunks of ceil(L/C) tokens, later ones short or empty: (offset, length), ``[P, R, 2]``."""
    width = -(-lengths // (2 * pcp_size))[:, None]
    offset = _chunk_index(pcp_size) * width
    length = np.minimum(np.maximum(lengths[:, None] - offset, 0), width)
    return offset, length


def _balanced_grid(lengths: np.ndarray, cut: np.ndarray, pcp_size: int):
    """Chunks of floor(L/C) or one more; each request's extras to the least-loaded ranks.

    Extras go one at a time to the rank of least load (ties to the lower rank, at most one
    per chunk: head first, then tail). Loads then stay within one of each other and the
    ranks ahead are always ranks 0..k-1, with k the extras handed out so far mod P; so
    rank r's place in the order of a request is (r - k) mod P for its head chunk and P
    more for its tail, and it gets an extra in each chunk whose place is below the
    request's number of extras.
    """
    num_chunks = 2 * pcp_size
    base = lengths // num_chunks
    extras = np.where(cut, lengths % num_chunks, 0)
    ahead = (np.cumsum(extras) - extras) % pcp_size
    place = (np.arange(pcp_size)[:, None] - ahead) % pcp_size  # [P, R]
    head_extra, tail_extra = extras > place, extras > place + pcp_size
    # Chunk c starts after c chunks of `base` and the extras of the chunks before it:
    # the heads of lower ranks for a head; every head and the tails of higher ranks for a tail.
    head_before = np.cumsum(head_extra, axis=0) - head_extra
    tail_before = head_extra.sum(axis=0) + (np.cumsum(tail_extra[::-1], axis=0)[::-1] - tail_extra)
    offset = _chunk_index(pcp_size) * base[:, None]
    offset[:, :, 0] += head_before
    offset[:, :, 1] += tail_before
    length = np.repeat(base[None, :, None], 2, axis=2) + np.stack([head_extra, tail_extra], axis=2)
    return offset, np.broadcast_to(length, offset.shape)


@dataclasses.dataclass(frozen=True)
class Segments:
    """Every rank's non-empty segments, rank after rank, each rank's in its execution order."""

    rank: np.ndarray
    req: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    per_rank: np.ndarray  # [P] segments of each rank
    tokens_per_rank: np.ndarray  # [P] rows of each rank
    seg_bounds: np.ndarray  # [P + 1] rank r's segments are [seg_bounds[r], seg_bounds[r + 1])
    local_first: np.ndarray  # each segment's first row inside its rank


def segments(grid: Grid) -> Segments:
    pcp_size, num_reqs, _ = grid.length.shape
    plane = 2 * num_reqs
    early = (grid.length > 0) & ~grid.late
    # [P, 2, R, 2]: per rank, its early cells then its late ones, each in (request, side) order.
    order = np.flatnonzero(np.stack([early, grid.late], axis=1))
    rank, in_plane = order // (2 * plane), order % plane
    cell = rank * plane + in_plane
    tokens_per_rank = grid.length.reshape(pcp_size, -1).sum(axis=1)
    return _segments(rank, in_plane >> 1, grid.offset.reshape(-1)[cell], grid.length.reshape(-1)[cell],
                     tokens_per_rank)


def _segments(rank: np.ndarray, req: np.ndarray, offset: np.ndarray, length: np.ndarray,
              tokens_per_rank: np.ndarray) -> Segments:
    pcp_size = tokens_per_rank.size
    per_rank = np.bincount(rank, minlength=pcp_size)
    seg_bounds = np.zeros(pcp_size + 1, dtype=np.int64)
    np.cumsum(per_rank, out=seg_bounds[1:])
    row_start = np.cumsum(tokens_per_rank) - tokens_per_rank
    local_first = np.cumsum(length) - length - row_start[rank]
    return Segments(rank, req, offset, length, per_rank, tokens_per_rank, seg_bounds, local_first)


def sharded_segments(lengths: np.ndarray, is_prefilling: np.ndarray, pcp_size: int) -> Segments:
    """The ``mrv2`` policy's segments with DCP off (every decode on one rank), built from a
    ``[P, D + 2 Rp]`` table (D: decode columns, Rp: prefills) instead of the ``[P, R, 2]`` grid.

    The k-th decode with tokens runs on rank k mod P, as column k // P of the decode part of
    the table; prefill i's head and tail chunks on rank r are columns 2i and 2i + 1 of the
    prefill part. A rank's row of the table is its execution order (decodes, then prefills,
    each in request order), so its non-empty cells, rank after rank, are the segments.
    """
    decodes = np.flatnonzero(~is_prefilling & (lengths > 0))
    prefills = np.flatnonzero(is_prefilling)
    width = -(-decodes.size // pcp_size)
    cols = width + 2 * prefills.size
    req = np.empty((pcp_size, cols), dtype=np.int64)
    offset = np.zeros((pcp_size, cols), dtype=np.int64)
    length = np.zeros((pcp_size, cols), dtype=np.int64)
    if decodes.size:  # padded to P * width with empty cells, then dealt out rank by rank
        dealt = np.zeros((2, width * pcp_size), dtype=np.int64)
        dealt[0, :decodes.size], dealt[1, :decodes.size] = decodes, lengths[decodes]
        req[:, :width], length[:, :width] = dealt.reshape(2, width, pcp_size).transpose(0, 2, 1)
    if prefills.size:
        chunk_offset, chunk_length = _ceil_grid(lengths[prefills], pcp_size)  # [P, Rp, 2]
        offset[:, width:] = chunk_offset.reshape(pcp_size, -1)
        length[:, width:] = chunk_length.reshape(pcp_size, -1)
        req[:, width:] = np.repeat(prefills, 2)
    cell = np.flatnonzero(length)
    return _segments(cell // cols, req.reshape(-1)[cell], offset.reshape(-1)[cell], length.reshape(-1)[cell],
                     length.sum(axis=1))


def sharded_tokens_per_rank(lengths: np.ndarray, is_prefilling: np.ndarray, pcp_size: int) -> np.ndarray:
    """[P] rows of each rank under `sharded_segments`, without the segments."""
    decodes = lengths[~is_prefilling & (lengths > 0)]
    dealt = np.zeros(-(-decodes.size // pcp_size) * pcp_size, dtype=np.int64)
    dealt[:decodes.size] = decodes
    return dealt.reshape(-1, pcp_size).sum(axis=0) + ceil_chunk_tokens(lengths[is_prefilling], pcp_size)


def ceil_chunk_tokens(prefill_lengths: np.ndarray, pcp_size: int) -> np.ndarray:
    """[P] tokens of each rank's head and tail chunks (``ceil`` chunking) over the prefills."""
    if prefill_lengths.size == 0:
        return np.zeros(pcp_size, dtype=np.int64)
    width = -(-prefill_lengths // (2 * pcp_size))[:, None]
    chunk = np.minimum(prefill_lengths[:, None] - _chunks(pcp_size) * width, width)
    per_chunk = np.maximum(chunk, 0, out=chunk).sum(axis=0)
    # Rank r holds chunks r and C-1-r; only the chunks from the last full one on are short.
    return per_chunk[:pcp_size] + per_chunk[::-1][:pcp_size]
