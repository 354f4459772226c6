"""The target model of one PCP rank (the `Model` protocol of `runner_fsm.replica.components`).

`forward` reads the step's inputs only from the persistent buffers, so the same function
serves eager steps, the CPU static replay and CUDA graph capture; it takes the fixed-shape
attention path when the agreement chose graph mode (uniform decode under FULL_DECODE_ONLY).
"""

from __future__ import annotations

import numpy as np
import torch

from runner_fsm.errors import BatchError
from runner_fsm.model.attention import AttentionInputs
from runner_fsm.model.decoder import MixtralDecoder
from runner_fsm.model.dispatch import ExchangeStep
from runner_fsm.model.exchange import RowRoles
from runner_fsm.model.parallel import all_gather_rows
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.pcp.context import PCPAttentionContext
from runner_fsm.replica.components import ForwardStep


class MixtralModel:
    def __init__(self, decoder: MixtralDecoder):
        self.decoder = decoder
        self.cfg = decoder.cfg
        self.groups = decoder.groups
        self.device = decoder.device

    @property
    def cache(self):
        return self.decoder.cache

    def forward(self, buffers: PersistentBuffers, step: ForwardStep) -> torch.Tensor:
        n = step.num_rows
        inputs = self.buffer_inputs(buffers, n, graph=step.agreed.use_graph)
        exchange = ExchangeStep.from_forward(step, n)
        roles = RowRoles(buffers.is_padding[:n], buffers.is_replicated[:n])
        return self.decoder.run(buffers.input_ids[:n], inputs, exchange, roles)

    def exchange_stats(self) -> dict:
        """What the last forward's expert exchanges moved (logged with the forward's record)."""
        return self.decoder.traffic.as_record()

    def buffer_inputs(self, buffers: PersistentBuffers, n: int, *, graph: bool) -> AttentionInputs:
        """Views of the buffers for `n` rows: no copies, so a captured graph sees new steps."""
        if buffers.pcp_size != self.decoder.kv_gather_size:
            raise BatchError(f"buffers are laid out for pcp_size={buffers.pcp_size}, this model"
                             f" runs with pcp_size={self.decoder.kv_gather_size}")
        slots = buffers.gathered_slot_mapping[: buffers.pcp_size * n]
        if not graph:
            self.cache.check_slots(slots, where=f"pcp rank {self.groups.pcp_rank}")
        return AttentionInputs(
            positions=buffers.positions[:n],
            query_start_loc=buffers.query_start_loc,
            seq_lens=buffers.seq_lens,
            block_tables=buffers.block_tables,
            slot_mapping=slots,
            num_segments=buffers.num_segments,
        )

    def restore(self, local: torch.Tensor, ctx: PCPAttentionContext) -> torch.Tensor:
        """Rows in global token order; a dummy restores its own rows without a collective."""
        n = ctx.num_tokens_padded
        if ctx.pcp_size != self.groups.pcp_size:
            raise BatchError(f"context is for pcp_size={ctx.pcp_size}, this model runs with"
                             f" pcp_size={self.groups.pcp_size}")
        index = torch.as_tensor(np.array(ctx.hidden_restore_idx), device=local.device)
        if ctx.is_dummy:
            # Every PCP rank of a replica is idle together, and rank r's restore index is
            # r*N + arange(N): exactly its own rows, so no rank needs a peer's.
            return local[index - ctx.pcp_rank * n]
        gathered = all_gather_rows(local[:n], self.groups.pcp, ctx.pcp_size)
        return gathered[index]

    def logits(self, restored: torch.Tensor) -> torch.Tensor:
        return self.decoder.logits(restored)

    def sample(self, restored: torch.Tensor) -> np.ndarray:
        return self.decoder.greedy(restored).cpu().numpy().astype(np.int64)
