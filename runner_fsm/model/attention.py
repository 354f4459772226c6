"""Paged causal attention over the KV cache, in an eager and a fixed-shape (graph) form.

A segment is a run of rows of one request: rows `query_start_loc[s]:query_start_loc[s+1]`,
block-table row `block_tables[s]`, keys at cache positions `0 .. seq_lens[s]-1`, and a row at
position p sees the keys at positions <= p. The eager form loops over segments on the host;
the graph form has no host reads and no data-dependent shapes (every row gathers its block
table's full width and masks), so it can be captured, and it must agree with the eager form.
"""

from __future__ import annotations

import dataclasses

import torch

from runner_fsm.model.kv_cache import PagedKVCache
from runner_fsm.model.layers import grouped_attention, per_row_attention


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionInputs:
    """Step inputs of one forward: views of the persistent buffers, or the draft's own rows."""

    positions: torch.Tensor  # [N] absolute position of each row
    query_start_loc: torch.Tensor  # [S+1] at capacity: trailing segments are empty
    seq_lens: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, B]
    slot_mapping: torch.Tensor  # [G] cache slot of each (gathered) new K/V row
    num_segments: int  # live segments; read by the eager form only


QUERY_BLOCK = 256  # query rows per score block of the eager form


def eager_attention(q: torch.Tensor, layer: int, cache: PagedKVCache, inputs: AttentionInputs) -> torch.Tensor:
    """q [N, H, d] -> [N, H, d]; rows outside every segment (padding) get zeros.

    Queries go in blocks of `QUERY_BLOCK` rows against the keys up to the block's last
    position only, so no score matrix is [rows, seq_len]: a causal segment of L rows costs
    about L^2/2 scores, not L^2, and its memory is bounded by the block. Keys a block row may
    not see are masked to probability 0 exactly, so the result is the full-matrix one up to
    the order of floating-point sums.
    """
    out = torch.zeros_like(q)
    s = inputs.num_segments
    starts = inputs.query_start_loc[: s + 1].tolist()
    seq_lens = inputs.seq_lens[:s].tolist()
    positions = inputs.positions[: starts[-1]].tolist() if s else []
    for seg in range(s):
        first, end = starts[seg], starts[seg + 1]
        if end == first:
            continue
        slots = cache.block_slots(inputs.block_tables[seg], seq_lens[seg])
        keys, values = cache.k[layer, slots], cache.v[layer, slots]
        for a in range(first, end, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, end)
            length = min(seq_lens[seg], max(positions[a:b]) + 1)
            key_pos = torch.arange(length, device=q.device)
            mask = key_pos[None, :] <= inputs.positions[a:b, None]
            out[a:b] = grouped_attention(q[a:b], keys[:length], values[:length], mask)
    return out


def graph_attention(q: torch.Tensor, layer: int, cache: PagedKVCache, inputs: AttentionInputs) -> torch.Tensor:
    """The same result as `eager_attention`, computed with static shapes only."""
    n = q.shape[0]
    rows = torch.arange(n, device=q.device)
    ends = inputs.query_start_loc[1:].to(torch.int64)
    last_seg = inputs.seq_lens.shape[0] - 1
    # Segment of each row: how many segments end at or before it.
    seg = torch.searchsorted(ends, rows, right=True).clamp(max=last_seg)
    slots = cache.block_slots(inputs.block_tables[seg])  # [N, B * block_size]
    key_pos = torch.arange(slots.shape[1], device=q.device)
    seq_len = inputs.seq_lens[seg].to(torch.int64)
    mask = (key_pos[None, :] < seq_len[:, None]) & (key_pos[None, :] <= inputs.positions[:, None])
    out = per_row_attention(q, cache.k[layer, slots], cache.v[layer, slots], mask)
    in_segment = rows < inputs.query_start_loc[-1].to(torch.int64)
    return out * in_segment[:, None, None].to(out.dtype)
