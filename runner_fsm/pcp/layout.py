"""The PCP plan's mechanics: segments as one grid, rows written once, no per-request Python.

Every policy first says, for each rank ``r``, request ``i`` and side ``s`` (0: head, 1:
tail), the offset and length of the segment of request ``i`` that rank ``r`` computes: a
``[P, R, 2]`` grid (a request that is not cut is one head segment, on every rank or on its
one owner). A rank's segments are the non-empty cells of its plane in (request, side)
order, with the cells the policy marks ``late`` moved after the others, keeping their
order; one ``flatnonzero`` over the grid lists every rank's segments in that order.

The rows are then written straight into the outputs, each once: a run of consecutive
integers per segment is a cumulative sum over a buffer holding 1 per row and, at each
segment's first row, the jump from the row before (``_runs``). Per-rank arrays are views
into one array shared by all ranks; the gathered layout is a ``[P, N]`` array whose rows are
the ranks, and each rank's ``token_idx`` is a view of its own row in it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

POLICIES = ("ceil", "balanced", "mrv2")


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where each rank's segment of each request lies: ``[P, R, 2]`` (rank, request, side)."""

    offset: np.ndarray  # first token's offset inside its request
    length: np.ndarray  # tokens; 0 where the rank computes nothing of that side
    late: np.ndarray  # bool: segments that go after the others of their rank, in order
    shared: np.ndarray  # [R] bool: requests every rank holds whole (rank 0's copy is owned)


def segment_grid(num_scheduled: np.ndarray, is_prefilling: np.ndarray, num_computed: np.ndarray,
                 pcp_size: int, policy: str, dcp_size: int = 1) -> Grid:
    """The grid of `policy` (see `plan.plan_batch` for what each policy does)."""
    lengths, num_chunks = num_scheduled, 2 * pcp_size
    if policy == "mrv2":
        cut = is_prefilling
        if dcp_size > 1:  # a prefill too short to fill every chunk is replicated instead
            cut = cut & ((num_chunks - 1) * -(-lengths // num_chunks) < lengths)
        owner = _decode_owner(lengths, ~cut, pcp_size) if dcp_size == 1 else None
    else:  # one rank cuts nothing; more ranks cut every prefill
        cut = is_prefilling if pcp_size > 1 else np.zeros_like(is_prefilling)
        owner = None
    offset, length = _whole_grid(lengths, pcp_size, owner)
    if cut.any():
        cut_offset, cut_length = (_balanced_grid if policy == "balanced" else _ceil_grid)(
            lengths, cut, pcp_size)
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
    shared = ~cut if owner is None else np.zeros_like(cut)
    return Grid(offset, length, late, shared)


def _whole_grid(lengths: np.ndarray, pcp_size: int, owner: np.ndarray | None):
    """Every request whole as a head segment: on every rank, or only on `owner[i]`."""
    length = np.zeros((pcp_size, lengths.size, 2), dtype=np.int64)
    if owner is None:
        length[:, :, 0] = lengths
    else:
        length[:, :, 0] = np.where(np.arange(pcp_size)[:, None] == owner, lengths, 0)
    return np.zeros_like(length), length


def _decode_owner(lengths: np.ndarray, whole: np.ndarray, pcp_size: int) -> np.ndarray:
    """MRV2's sharded decodes: the k-th whole request with tokens goes to rank k mod P."""
    counted = whole & (lengths > 0)
    return (np.cumsum(counted) - counted) % pcp_size


def _chunk_index(pcp_size: int) -> np.ndarray:
    """[P, 1, 2]: rank r's head chunk r and tail chunk 2P-1-r."""
    ranks = np.arange(pcp_size)
    return np.stack([ranks, 2 * pcp_size - 1 - ranks], axis=1)[:, None, :]


def _ceil_grid(lengths: np.ndarray, cut: np.ndarray, pcp_size: int):
    """Chunks of ceil(L/C) tokens, later ones short or empty."""
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


def segments(grid: Grid) -> Segments:
    pcp_size, num_reqs, _ = grid.length.shape
    plane = 2 * num_reqs
    early = (grid.length > 0) & ~grid.late
    # [P, 2, R, 2]: per rank, its early cells then its late ones, each in (request, side) order.
    order = np.flatnonzero(np.stack([early, grid.late], axis=1))
    rank, in_plane = order // (2 * plane), order % plane
    cell = rank * plane + in_plane
    length = grid.length.reshape(-1)[cell]
    per_rank = np.bincount(rank, minlength=pcp_size)
    tokens_per_rank = grid.length.reshape(pcp_size, -1).sum(axis=1)
    return Segments(rank, in_plane >> 1, grid.offset.reshape(-1)[cell], length, per_rank, tokens_per_rank)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The plan's arrays, written once; the per-rank arrays are sliced out of them."""

    gathered: np.ndarray  # [P, N] global token per row, 0 for padding
    write_mask: np.ndarray  # [P, N]
    restore: np.ndarray  # [T]
    req: np.ndarray  # [sum n_r] rank after rank
    positions: np.ndarray  # [sum n_r]
    query_start_loc: np.ndarray  # [num segments + P]: per rank, 0 then its segment ends
    seq_lens: np.ndarray  # [num segments]
    row_bounds: np.ndarray  # [P + 1]
    seg_bounds: np.ndarray  # [P + 1]


def rows(segs: Segments, shared: np.ndarray, num_scheduled: np.ndarray, num_computed: np.ndarray,
         padded: int) -> Rows:
    pcp_size = segs.per_rank.size
    counts, length = segs.tokens_per_rank, segs.length
    seg_bounds = _bounds(segs.per_rank)
    row_bounds = _bounds(counts)
    end_row = np.cumsum(length)
    first_row = end_row - length
    req_start = np.cumsum(num_scheduled) - num_scheduled
    token0 = req_start[segs.req] + segs.offset
    pos0 = num_computed[segs.req] + segs.offset
    seq_lens = pos0 + length

    # One allocation holds every big output (gathered layout, positions, request per row,
    # restore index), each written once, with no temporary as large: on a machine where
    # fresh pages cost as much as the writes, a temporary doubles the cost, and one block
    # freed whole stays in malloc's heap for the next step where several are trimmed.
    total_rows, total = int(row_bounds[-1]), int(num_scheduled.sum())
    block = np.empty(pcp_size * padded + 2 * total_rows + total, dtype=np.int64)
    gathered = block[:pcp_size * padded].reshape(pcp_size, padded)
    positions, req, restore = np.split(block[pcp_size * padded:], [total_rows, 2 * total_rows])

    local_first = gathered_rows(gathered, segs, token0, first_row, row_bounds, seg_bounds)

    positions.fill(1)
    _jumps(positions, first_row, pos0, length, 1)
    np.cumsum(positions, out=positions)
    req.fill(0)
    _jumps(req, first_row, segs.req, length, 0)
    np.cumsum(req, out=req)

    owned = (segs.rank == 0) | ~shared[segs.req]
    write_mask = write_mask_rows(segs, owned, seg_bounds, padded)
    _restore(restore, token0[owned], (segs.rank * padded + local_first)[owned], length[owned])
    in_pieces = np.arange(length.size) + segs.rank
    qsl = np.zeros(length.size + pcp_size, dtype=np.int64)
    qsl[in_pieces + 1] = end_row - row_bounds[segs.rank]
    return Rows(gathered, write_mask, restore, req, positions, qsl, seq_lens, row_bounds, seg_bounds)


def gathered_rows(gathered: np.ndarray, segs: Segments, token0: np.ndarray, first_row: np.ndarray,
                  row_bounds: np.ndarray, seg_bounds: np.ndarray) -> np.ndarray:
    """Fill the [P, N] gathered layout (rank r's rows at [r, :n_r], 0 for padding); each
    rank's row restarts the runs. Returns each segment's first row inside its rank."""
    pcp_size, padded = gathered.shape
    counts, length = segs.tokens_per_rank, segs.length
    local_first = first_row - row_bounds[segs.rank]
    for r, n_r in enumerate(counts.tolist()):
        gathered[r, :n_r] = 1
        gathered[r, n_r:] = 0
    _jumps(gathered.reshape(-1), segs.rank * padded + local_first, token0, length, 1,
           seg_bounds[:-1][segs.per_rank > 0])
    pads = np.flatnonzero(counts < padded)
    if pads.size:  # a rank's padding starts with the jump from its last token back to 0
        last = np.zeros(pcp_size, dtype=np.int64)
        ends = seg_bounds[1:][segs.per_rank > 0] - 1
        last[segs.rank[ends]] = token0[ends] + length[ends] - 1
        gathered.reshape(-1)[pads * padded + counts[pads]] = -last[pads]
    np.cumsum(gathered, axis=1, out=gathered)
    return local_first


def write_mask_rows(segs: Segments, owned: np.ndarray, seg_bounds: np.ndarray, padded: int) -> np.ndarray:
    """[P, N] write mask, padding included, in one repeat: each rank's segments, then its pad."""
    pcp_size, length = segs.per_rank.size, segs.length
    in_pieces = np.arange(length.size) + segs.rank
    piece_len = np.zeros(length.size + pcp_size, dtype=np.int64)
    piece_len[in_pieces] = length
    piece_len[seg_bounds[1:] + np.arange(pcp_size)] = padded - segs.tokens_per_rank
    piece_owned = np.zeros(piece_len.size, dtype=bool)
    piece_owned[in_pieces] = owned
    return np.repeat(piece_owned, piece_len).reshape(pcp_size, padded)


def gathered_layout(segs: Segments, shared: np.ndarray, req_start: np.ndarray, total: int, padded: int):
    """Only the gathered layout: (gathered [P, N], write mask [P, N], restore [T]), what
    vLLM MRV2's `_build_batch_layout` makes, without the per-rank rows."""
    pcp_size, length = segs.per_rank.size, segs.length
    seg_bounds, row_bounds = _bounds(segs.per_rank), _bounds(segs.tokens_per_rank)
    first_row = np.cumsum(length) - length
    token0 = req_start[segs.req] + segs.offset
    block = np.empty(pcp_size * padded + total, dtype=np.int64)
    gathered, restore = block[:pcp_size * padded].reshape(pcp_size, padded), block[pcp_size * padded:]
    local_first = gathered_rows(gathered, segs, token0, first_row, row_bounds, seg_bounds)
    owned = (segs.rank == 0) | ~shared[segs.req]
    _restore(restore, token0[owned], (segs.rank * padded + local_first)[owned], length[owned])
    return gathered, write_mask_rows(segs, owned, seg_bounds, padded), restore


def _bounds(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _jumps(buffer: np.ndarray, at: np.ndarray, first: np.ndarray, length: np.ndarray, step: int,
           restart: np.ndarray | None = None) -> None:
    """Into `buffer`, holding `step` per row, write the jumps that make its cumsum run
    `first[s]`, `first[s] + step`, ... from row `at[s]`; a segment listed in `restart`
    follows a row boundary of the cumsum (it starts from 0)."""
    jump = first.copy()
    jump[1:] -= first[:-1] + step * (length[:-1] - 1)
    if restart is not None:
        jump[restart] = first[restart]
    buffer[at] = jump


def _restore(out: np.ndarray, token0: np.ndarray, row0: np.ndarray, length: np.ndarray) -> None:
    """[T] gathered row of each global token, from the owned segments (which tile 0..T-1).

    restore[t] = t + (row0 - token0) of the segment holding t: a cumsum of 1 per token
    plus, at each segment's first token, its shift, and minus it past its last one.
    """
    total = out.size
    if total == 0:
        return
    out.fill(1)
    out[0] = 0
    shift = row0 - token0
    out[token0] += shift
    end = token0 + length
    inside = end < total
    out[end[inside]] -= shift[inside]
    np.cumsum(out, out=out)
