"""KV-cache placement: which cache slot each token's K/V is written to.

DESIGN.md section 4 is the contract. PCP does not shard the KV cache (every PCP rank gathers
the step's K/V and writes it whole); only DCP shards it, token by token in runs of
``interleave`` positions. ``PAD_SLOT_ID`` marks a row whose K/V must not be written.
"""

from __future__ import annotations

import numpy as np

from runner_fsm.errors import BatchError
from runner_fsm.pcp.arrays import ArrayLike, int_array
from runner_fsm.pcp.plan import PCPPlan

PAD_SLOT_ID = -1



def _check_layout(block_size: int, dcp_size: int, dcp_rank: int, interleave: int) -> None:
    sizes = (("block_size", block_size), ("dcp_size", dcp_size), ("interleave", interleave))
    for name, value in sizes:
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise BatchError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(dcp_rank, (int, np.integer)) or not 0 <= dcp_rank < dcp_size:
        raise BatchError(f"dcp_rank must lie in [0, {dcp_size}), got {dcp_rank!r}")
    # A block holds block_size tokens of its owner; runs of `interleave` tokens must tile it,
    # else a run would spill into the next block of the owner's cache.
    if dcp_size > 1 and block_size % interleave:
        raise BatchError(
            f"interleave={interleave} must divide block_size={block_size} when dcp_size={dcp_size}"
        )


def _first(mask: np.ndarray) -> int | None:
    if not mask.any():  # the common case: one reduction, no index array
        return None
    return int(np.flatnonzero(mask)[0])


def _check_tokens(
    positions: np.ndarray, req_idx: np.ndarray, block_tables: np.ndarray, span: int
) -> np.ndarray:
    """Validate every token against the tables; returns each token's block index."""
    if positions.shape != req_idx.shape:
        raise BatchError(
            f"positions and req_idx must have one entry per token, got lengths"
            f" {positions.shape[0]} and {req_idx.shape[0]}"
        )
    num_reqs, width = block_tables.shape
    t = _first(positions < 0)
    if t is not None:
        raise BatchError(f"request {req_idx[t]}: token {t} has negative position {positions[t]}")
    t = _first((req_idx < 0) | (req_idx >= num_reqs))
    if t is not None:
        raise BatchError(
            f"request {req_idx[t]} (token {t}, position {positions[t]}) has no block-table row;"
            f" block_tables has {num_reqs} rows"
        )
    blk = positions // span
    t = _first(blk >= width)
    if t is not None:
        raise BatchError(
            f"request {req_idx[t]}, position {positions[t]}: needs block {blk[t]}, beyond its"
            f" block-table row of {width} blocks ({span} positions per block)"
        )
    # Checked on every DCP rank, owner or not, so that all ranks reject the same batch.
    t = _first(block_tables[req_idx, blk] < 0)
    if t is not None:
        raise BatchError(
            f"request {req_idx[t]}, position {positions[t]}: block {blk[t]} has invalid block id"
            f" {block_tables[req_idx[t], blk[t]]}"
        )
    return blk


def slot_mapping(
    positions: ArrayLike,
    req_idx: ArrayLike,
    block_tables: ArrayLike,
    block_size: int,
    *,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> np.ndarray:
    """Cache slot of each token (int64), ``PAD_SLOT_ID`` where another DCP rank owns it.

    ``positions[t]`` is token t's absolute position in request ``req_idx[t]``, whose block
    table is row ``req_idx[t]`` of ``block_tables``.
    """
    _check_layout(block_size, dcp_size, dcp_rank, interleave)
    pos = int_array("positions", positions, 1)
    req = int_array("req_idx", req_idx, 1)
    tables = int_array("block_tables", block_tables, 2)
    span = block_size * dcp_size  # positions covered by one logical block across DCP ranks
    blk = _check_tokens(pos, req, tables, span)
    base = tables[req, blk] * block_size
    off = pos % span
    if dcp_size == 1:
        return base + off
    owner = (off // interleave) % dcp_size
    local = (off // (interleave * dcp_size)) * interleave + off % interleave
    return np.where(owner == dcp_rank, base + local, PAD_SLOT_ID).astype(np.int64)


def gathered_slot_mapping(global_slots: ArrayLike, plan: PCPPlan) -> np.ndarray:
    """[P*N] slots of the gathered rows: each real new token once, ``PAD_SLOT_ID`` elsewhere.

    Replicated decode rows write only through rank 0's copy (``plan.kv_write_mask``), so a
    token's K/V reaches the cache exactly once however many ranks computed it.
    """
    slots = int_array("global_slots", global_slots, 1)
    if slots.shape[0] != plan.num_tokens:
        raise BatchError(
            f"global_slots has {slots.shape[0]} entries,"
            f" the plan has {plan.num_tokens} global tokens"
        )
    out = np.full(plan.padded_gather_idx.shape[0], PAD_SLOT_ID, dtype=np.int64)
    mask = plan.kv_write_mask
    out[mask] = slots[plan.padded_gather_idx[mask]]
    return out


def dummy_slot_mapping(num_tokens: int) -> np.ndarray:
    """Slots of a dummy batch: nothing is written."""
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise BatchError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    return np.full(int(num_tokens), PAD_SLOT_ID, dtype=np.int64)
