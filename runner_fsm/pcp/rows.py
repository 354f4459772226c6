"""A plan's rows, written from its segments: the gathered layout every PCP rank shares at
once, and one rank's own rows only when that rank asks for them.

Every index array of a plan is, segment by segment, a run of consecutive integers. The
gathered layout and the restore index are written by one running sum each, straight into
the output: over a per-thread scratch of ones into which each segment's first row holds
the jump from the row before (`_Ones`), reset to ones afterwards. That is one pass over the
output and no temporary as large as it; numpy's `repeat`, the other way to write runs,
needs a temporary, and a large temporary may come back from the allocator as fresh pages.

Fresh pages are the real cost at the memory limit: the kernel faults each 4 KiB page in on
its first write, which on this machine's VM costs more than the write (about 1 ms for the
4.6 MB of the 512-request batch's layout). A `PlanWorkspace` kept by the caller holds the
outputs from step to step, so that its pages are faulted in once.

The per-rank rows (positions, request of each row, segment bounds) are not built here
for every rank: a PCP rank executes only its own, so `rank_rows` builds one rank's on
demand, and `global_rows` gives the positions of every global token straight from the
batch, without going through the ranks.
"""

from __future__ import annotations

import threading

import numpy as np

from runner_fsm.pcp.layout import Segments

_COUNT = np.arange(1 << 16, dtype=np.int64)
_COUNT.flags.writeable = False


def counting(n: int) -> np.ndarray:
    """``np.arange(n)`` as a read-only view of one shared array (grown when too short)."""
    global _COUNT
    if _COUNT.size < n:
        grown = np.arange(max(n, 2 * _COUNT.size), dtype=np.int64)
        grown.flags.writeable = False
        _COUNT = grown
    return _COUNT[:n]


class PlanWorkspace:
    """Memory a caller keeps for its plans, step after step: the gathered layout, the write
    mask and the restore index are written into it instead of into fresh arrays.

    Fresh memory costs a page fault per 4 KiB page on its first write, which on this VM costs
    more than the write itself (about 1 ms per 4.6 MB, the 512-request batch's layout); a
    workspace faults its pages in once. A plan written into a workspace is valid until the
    next plan is written into the same one: a caller that keeps a plan's arrays longer copies
    them (the PCP attention context does).
    """

    def __init__(self) -> None:
        self._ints = np.empty(0, dtype=np.int64)
        self._bools = np.empty(0, dtype=bool)
        self.scratch = np.empty(0, dtype=np.int64)  # the compiled layout's per-rank counters
        self.addresses = (0, 0, 0)  # of ints, bools, scratch: for the compiled layout

    def take(self, num_ints: int, num_bools: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of `num_ints` int64 and `num_bools` bool entries (grown by a quarter more
        than asked, so that slowly growing batches do not reallocate every step)."""
        self.reserve(num_ints, num_bools)
        return self._ints[:num_ints], self._bools[:num_bools]

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole int64 and bool buffers (what `take` hands out views of)."""
        return self._ints, self._bools

    def reserve(self, num_ints: int, num_bools: int, num_scratch: int = 0) -> None:
        """Room for at least that many entries of each (see `take`)."""
        if self._ints.size < num_ints:
            self._ints = np.empty(num_ints + num_ints // 4, dtype=np.int64)
        elif self._bools.size >= num_bools and self.scratch.size >= num_scratch:
            return
        if self._bools.size < num_bools:
            self._bools = np.empty(num_bools + num_bools // 4, dtype=bool)
        if self.scratch.size < num_scratch:
            self.scratch = np.empty(num_scratch, dtype=np.int64)
        # addresses are read once per growth: numpy's `.ctypes.data` costs about 1.5 us a read
        self.addresses = (self._ints.ctypes.data, self._bools.ctypes.data, self.scratch.ctypes.data)


class _Ones(threading.local):
    """A per-thread scratch of ones, grown on demand; every user leaves it all ones."""

    def __init__(self) -> None:
        self.array = np.ones(1 << 16, dtype=np.int64)

    def take(self, n: int) -> np.ndarray:
        if self.array.size < n:
            self.array = np.ones(n + n // 4, dtype=np.int64)
        return self.array


_ONES = _Ones()


def _runs(ones: np.ndarray, at: np.ndarray, start: np.ndarray, length: np.ndarray,
          restart: np.ndarray) -> None:
    """Put into `ones` the jumps that make its running sum, from row ``at[s]`` on, count
    ``start[s], start[s] + 1, ...`` for ``length[s]`` rows. Segments follow one another row
    by row; those in `restart` begin a new running sum (a new rank). The caller sums, then
    sets ``ones[at]`` back to 1."""
    jump = start.copy()
    jump[1:] -= start[:-1] + length[:-1] - 1
    jump[restart] = start[restart]
    ones[at] = jump


def gathered_layout(segs: Segments, shared: np.ndarray, req_start: np.ndarray, total: int,
                    padded: int, workspace: PlanWorkspace | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gathered ``[P, N]``, write mask ``[P, N]``, restore ``[T]``) of the segments.

    Rank ``r``'s row ``k < n_r`` of the gathered layout holds the global token there, its
    rows from ``n_r`` on are padding (token 0, not written). The write mask marks the rows
    whose K/V this step writes: every row but the copies of a request that every rank
    holds whole (rank 0's copy writes). ``restore[t]`` is the gathered row (``r * N + k``)
    of global token ``t``'s written copy.
    """
    pcp_size, counts, length = segs.per_rank.size, segs.tokens_per_rank.tolist(), segs.length
    size = pcp_size * padded
    if workspace is None:
        block, write_mask = np.empty(size + total, dtype=np.int64), np.empty(size, dtype=bool)
    else:
        block, write_mask = workspace.take(size + total, size)
    gathered, restore = block[:size].reshape(pcp_size, padded), block[size:]
    write_mask = write_mask.reshape(pcp_size, padded)
    token0 = req_start[segs.req] + segs.offset
    row0 = segs.rank * padded + segs.local_first
    ones = _ONES.take(max(size, total + 1))

    # Gathered: rank r's runs in ones[r * N:], each rank's first segment restarting the sum.
    _runs(ones, row0, token0, length, segs.seg_bounds[:-1][segs.per_rank > 0])
    try:
        for r, n_r in enumerate(counts):
            np.cumsum(ones[r * padded:r * padded + n_r], out=gathered[r, :n_r])
            gathered[r, n_r:] = 0
    finally:
        ones[row0] = 1

    owned = _owned(segs, shared)
    if owned is None:  # every segment writes: each rank's rows, not its padding
        for r, n_r in enumerate(counts):
            write_mask[r, :n_r] = True
            write_mask[r, n_r:] = False
    else:
        piece = np.arange(length.size) + segs.rank
        piece_len = np.zeros(length.size + pcp_size, dtype=np.int64)
        piece_len[piece] = length
        piece_len[segs.seg_bounds[1:] + np.arange(pcp_size)] = padded - segs.tokens_per_rank
        piece_owned = np.zeros(piece_len.size, dtype=bool)
        piece_owned[piece] = owned
        write_mask[...] = np.repeat(piece_owned, piece_len).reshape(pcp_size, padded)
        token0, row0, length = token0[owned], row0[owned], length[owned]

    # Restore: the written copies tile tokens 0..T-1 in some order; restore[t] = t + shift of
    # its segment, so the sum jumps by +shift at a segment's first token and -shift past its last.
    if total:
        shift, end = row0 - token0, token0 + length
        inside = end < total
        try:
            ones[token0] += shift
            ones[end[inside]] -= shift[inside]
            ones[0] -= 1
            np.cumsum(ones[:total], out=restore)
        finally:  # every end inside is another segment's first token
            ones[token0] = 1
    return gathered, write_mask, restore


def _owned(segs: Segments, shared: np.ndarray) -> np.ndarray | None:
    """[S] segments whose rows write K/V; None when all of them do."""
    if not shared.any() or segs.per_rank.size == 1:
        return None
    return ~shared[segs.req] | (segs.rank == 0)


def replicated_rows(segs: Segments, shared: np.ndarray, rank: int) -> np.ndarray:
    """[n_r] bool: rank `rank`'s rows whose request every PCP rank holds whole."""
    lo, hi = segs.seg_bounds[rank], segs.seg_bounds[rank + 1]
    if segs.per_rank.size == 1:
        return np.zeros(int(segs.tokens_per_rank[rank]), dtype=bool)
    return np.repeat(shared[segs.req[lo:hi]], segs.length[lo:hi])


def rank_rows(segs: Segments, num_computed: np.ndarray, rank: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s own rows: request and position of each row, and per segment its
    row bounds (``query_start_loc``), causal key length (``seq_lens``) and request."""
    lo, hi = int(segs.seg_bounds[rank]), int(segs.seg_bounds[rank + 1])
    req, length = segs.req[lo:hi], segs.length[lo:hi]
    pos0 = num_computed[req] + segs.offset[lo:hi]
    positions = np.repeat(pos0 - segs.local_first[lo:hi], length)
    positions += counting(positions.size)
    query_start_loc = np.zeros(hi - lo + 1, dtype=np.int64)
    np.cumsum(length, out=query_start_loc[1:])
    return {"req_idx": np.repeat(req, length), "positions": positions,
            "query_start_loc": query_start_loc, "seq_lens": pos0 + length, "seg_req_idx": req}


def global_rows(num_scheduled: np.ndarray, num_computed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, request) of every global token, in global order."""
    total = int(num_scheduled.sum())
    req_start = np.cumsum(num_scheduled) - num_scheduled
    positions = np.repeat(num_computed - req_start, num_scheduled)
    positions += counting(total)
    return positions, np.repeat(counting(num_scheduled.size), num_scheduled)
