"""The replicated draft model (the `Drafter` protocol of `runner_fsm.replica.components`).

It runs its replica's global batch on every PCP rank (no PCP split), with its own paged KV
cache under the target's block ids, and its experts are parallel over every rank like the
target's: each exchange is sized from the draft agreement in `step.agreed`. An idle replica
runs dummies of the agreed size through the same collectives.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from runner_fsm.batch import ScheduledBatch
from runner_fsm.model import draft_rows
from runner_fsm.model.attention import AttentionInputs
from runner_fsm.model.decoder import MixtralDecoder
from runner_fsm.model.dispatch import ExchangeStep
from runner_fsm.model.exchange import RowRoles
from runner_fsm.replica.components import ForwardStep


@dataclasses.dataclass
class _Proposing:
    """The requests of the step being drafted and what has been proposed for them so far."""

    req_ids: tuple[str, ...]
    block_tables: np.ndarray
    next_positions: np.ndarray  # where the last proposal goes into the draft
    tokens: list[list[int]]


class MixtralDrafter:
    def __init__(self, decoder: MixtralDecoder):
        self.decoder = decoder
        self.cache = decoder.cache
        self._proposing: _Proposing | None = None

    def prefill_rows(self, batch: ScheduledBatch, sampled: dict[str, list[int]]) -> int:
        return draft_rows.prefill_row_count(batch, sampled)

    def prefill(self, batch: ScheduledBatch | None, sampled: dict[str, list[int]] | None,
                step: ForwardStep) -> None:
        if batch is None:
            self._proposing = None
            self._forward(draft_rows.dummy_rows(step.num_rows), step)
            return
        rows = draft_rows.prefill_rows(batch, sampled or {}, block_size=self.cache.block_size,
                                       num_blocks=self.cache.num_blocks)
        hidden = self._forward(rows, step)
        last = rows.last_rows
        first = self.decoder.greedy(hidden[torch.as_tensor(last, device=hidden.device)])
        self._proposing = _Proposing(
            req_ids=batch.req_ids,
            block_tables=np.asarray(batch.block_tables, dtype=np.int64),
            next_positions=rows.positions[last] + 1,
            tokens=[[int(t)] for t in first.tolist()],
        )

    def decode(self, step: ForwardStep) -> None:
        state = self._proposing
        if state is None:
            self._forward(draft_rows.dummy_rows(step.num_rows), step)
            return
        rows = draft_rows.decode_rows(
            np.array([tokens[-1] for tokens in state.tokens]), state.next_positions,
            state.block_tables, block_size=self.cache.block_size, num_blocks=self.cache.num_blocks)
        proposed = self.decoder.greedy(self._forward(rows, step)).tolist()
        for tokens, token in zip(state.tokens, proposed):
            tokens.append(int(token))
        state.next_positions = state.next_positions + 1

    def proposals(self) -> dict[str, list[int]]:
        state = self._proposing
        if state is None:
            return {}
        return {rid: list(tokens) for rid, tokens in zip(state.req_ids, state.tokens)}

    def _forward(self, rows: draft_rows.DraftRows, step: ForwardStep) -> torch.Tensor:
        device = self.decoder.device

        def put(array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)

        inputs = AttentionInputs(
            positions=put(rows.positions),
            query_start_loc=put(rows.query_start_loc, torch.int32),
            seq_lens=put(rows.seq_lens, torch.int32),
            block_tables=put(rows.block_tables, torch.int32),
            slot_mapping=put(rows.slots),
            num_segments=int(rows.seq_lens.shape[0]),
        )
        exchange = ExchangeStep.from_forward(step, rows.num_rows)
        # The draft runs its replica's global batch on every PCP rank: every row is replicated.
        roles = RowRoles.uniform(rows.num_rows, device, padding=step.is_dummy,
                                 replicated=self.decoder.groups.pcp_size > 1)
        return self.decoder.run(put(rows.input_ids), inputs, exchange, roles)
