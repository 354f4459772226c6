"""The rows a draft forward runs, computed from the scheduled batch and what the target kept.

For a request with scheduled tokens x_0..x_{m-1} at positions c..c+m-1 and appended tokens
y_1..y_a (what verification kept, a >= 1), the draft's input is the prompt chunk x_0..x_{m-1}
then y_1 for a prefill (m + 1 rows; a = 1), and x_0 then y_1..y_a for a decode (a + 1 rows;
y_1..y_{a-1} are the accepted drafts), at positions contiguous from c. Positions from c on are
rewritten every step, so K/V left by rejected drafts is overwritten before anything reads it.

The draft writes K/V past the target's positions (its proposals), in the request's own
blocks: a block-table column counts while its id is a valid block, so the scheduler must give
each request lookahead blocks as vLLM does. A position with no block is not written and is
not a key; its row still runs (its proposal may then be worse, never the target's output).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from runner_fsm.batch import ScheduledBatch
from runner_fsm.errors import BatchError
from runner_fsm.pcp.kv import PAD_SLOT_ID


@dataclasses.dataclass(frozen=True, eq=False)
class DraftRows:
    """One draft forward, one segment per request; identical on every PCP rank of a replica."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R] causal key length, capped at the request's backed positions
    block_tables: np.ndarray  # [R, B]
    slots: np.ndarray  # [T] PAD_SLOT_ID where no block backs the position

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_rows(self) -> np.ndarray:
        return self.query_start_loc[1:] - 1


def draft_inputs(batch: ScheduledBatch, sampled: dict[str, list[int]]) -> list[np.ndarray]:
    """Per request, the tokens the draft processes this step (see the module docstring)."""
    starts = np.cumsum(batch.num_scheduled) - batch.num_scheduled
    out = []
    for i, rid in enumerate(batch.req_ids):
        kept = sampled.get(rid)
        if not kept:
            raise BatchError(f"draft prefill: request {rid!r} has no sampled token this step")
        known = int(batch.num_scheduled[i]) if batch.is_prefilling[i] else 1
        out.append(np.concatenate([batch.token_ids[starts[i]:starts[i] + known],
                                   np.asarray(kept, dtype=np.int64)]))
    return out


def prefill_row_count(batch: ScheduledBatch, sampled: dict[str, list[int]]) -> int:
    return sum(len(tokens) for tokens in draft_inputs(batch, sampled))


def prefill_rows(batch: ScheduledBatch, sampled: dict[str, list[int]], *, block_size: int,
                 num_blocks: int) -> DraftRows:
    tokens = draft_inputs(batch, sampled)
    return _assemble(tokens, batch.num_computed, batch.block_tables, block_size, num_blocks)


def decode_rows(tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray, *,
                block_size: int, num_blocks: int) -> DraftRows:
    """One row per request: its last proposal at the next position."""
    per_request = [np.asarray([t], dtype=np.int64) for t in tokens]
    return _assemble(per_request, positions, block_tables, block_size, num_blocks)


def dummy_rows(num_rows: int) -> DraftRows:
    """An idle replica's draft forward: one segment, position 0, nothing written."""
    return DraftRows(
        input_ids=np.zeros(num_rows, dtype=np.int64),
        positions=np.zeros(num_rows, dtype=np.int64),
        query_start_loc=np.array([0, num_rows], dtype=np.int64),
        seq_lens=np.ones(1, dtype=np.int64),
        block_tables=np.zeros((1, 1), dtype=np.int64),
        slots=np.full(num_rows, PAD_SLOT_ID, dtype=np.int64),
    )


def backed_positions(table_row: np.ndarray, block_size: int, num_blocks: int) -> int:
    """Positions covered by the leading run of valid block ids of one block-table row."""
    valid = (table_row >= 0) & (table_row < num_blocks)
    invalid = np.flatnonzero(~valid)
    columns = int(invalid[0]) if invalid.size else int(table_row.shape[0])
    return columns * block_size


def _assemble(tokens: list[np.ndarray], first_positions: np.ndarray, block_tables: np.ndarray,
              block_size: int, num_blocks: int) -> DraftRows:
    tables = np.asarray(block_tables, dtype=np.int64)
    lengths = np.array([t.shape[0] for t in tokens], dtype=np.int64)
    first = np.asarray(first_positions, dtype=np.int64)
    capacity = np.array([backed_positions(row, block_size, num_blocks) for row in tables], dtype=np.int64)
    req = np.repeat(np.arange(len(tokens)), lengths)
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = first[req] + offsets
    backed = positions < capacity[req]
    column = np.where(backed, positions // block_size, 0)
    slots = np.where(backed, tables[req, column] * block_size + positions % block_size, PAD_SLOT_ID)
    return DraftRows(
        input_ids=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64),
        positions=positions,
        query_start_loc=np.concatenate([[0], np.cumsum(lengths)]),
        seq_lens=np.minimum(first + lengths, capacity),
        block_tables=tables,
        slots=slots.astype(np.int64),
    )
