"""Fakes behind the replica's interfaces: a model and a drafter whose outputs are a pure
function of the persistent buffers, and scripted peers for the agreement."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from runner_fsm import dp
from runner_fsm.batch import ScheduledBatch
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.pcp.context import PCPAttentionContext

VOCAB = 997


class FakeModel:
    """Row output = (input_id * 31 + position) mod VOCAB, read from the buffers only.

    `pcp_group` (optional) all-gathers the PCP ranks' rows, as the real model does.
    """

    def __init__(self, pcp_group=None, *, calls: list | None = None):
        self.pcp_group = pcp_group
        self.calls = calls if calls is not None else []
        self.last_input_ids: torch.Tensor | None = None

    def forward(self, buffers: PersistentBuffers, step) -> torch.Tensor:
        num_tokens = step.num_rows
        self.calls.append(("forward", num_tokens, step.agreed.num_tokens_across_dp))
        ids = buffers.input_ids[:num_tokens]
        self.last_input_ids = ids.clone()
        out = torch.add(buffers.positions[:num_tokens], ids, alpha=31)
        return out.remainder_(VOCAB).unsqueeze(1)

    def restore(self, local: torch.Tensor, ctx: PCPAttentionContext) -> torch.Tensor:
        if ctx.pcp_size > 1 and self.pcp_group is not None:
            parts = [torch.empty_like(local) for _ in range(ctx.pcp_size)]
            dist.all_gather(parts, local.contiguous(), group=self.pcp_group)
            gathered = torch.cat(parts)
        elif ctx.pcp_size > 1:  # a dummy needs no peers: it restores only its own rows
            gathered = local.new_zeros((ctx.pcp_size * local.shape[0],) + tuple(local.shape[1:]))
            gathered[ctx.local_rows()] = local
        else:
            gathered = local
        return gathered[torch.as_tensor(np.array(ctx.hidden_restore_idx))]

    def sample(self, restored: torch.Tensor) -> np.ndarray:
        return restored[:, 0].numpy()


def expected_tokens(batch: ScheduledBatch) -> dict[str, list[int]]:
    """What FakeModel samples for a batch without drafts, computed from the batch alone."""
    last = np.cumsum(batch.num_scheduled) - 1
    pos = (batch.num_computed + batch.num_scheduled - 1)
    return {rid: [int((batch.token_ids[i] * 31 + p) % VOCAB)] for rid, i, p in zip(batch.req_ids, last, pos)}


class FakeDrafter:
    """Counts draft forwards; proposes `k` tokens per request (the last sampled, repeated)."""

    def __init__(self, k: int):
        self.k = k
        self.calls: list[tuple[str, int]] = []
        self._last: dict[str, int] = {}

    def prefill_rows(self, batch, sampled) -> int:
        return sum(len(tokens) + 1 for tokens in sampled.values())

    def prefill(self, batch, sampled, step) -> None:
        self.calls.append(("prefill", step.num_rows))
        self._last = {rid: tokens[-1] for rid, tokens in (sampled or {}).items()}

    def decode(self, step) -> None:
        self.calls.append(("decode", step.num_rows))

    def proposals(self) -> dict[str, list[int]]:
        return {rid: [tok] * self.k for rid, tok in self._last.items()}


class ScriptedPeers:
    """The agreement of replica 0 with scripted peers: `peers(local)` returns their columns.

    Lets one process test hand-offs that need busy peers (an idle replica only runs its
    dummy forward when some peer has work). The rule applied is the real `dp.agree`.
    """

    def __init__(self, peers, capture_sizes: Sequence[int] = ()):
        self.peers = peers
        self.capture_sizes = tuple(capture_sizes)
        self.sent: list[dp.LocalDispatch] = []

    def sync(self, local: dp.LocalDispatch) -> dp.DPSyncState:
        self.sent.append(local)
        return dp.agree([local, *self.peers(local)], capture_sizes=self.capture_sizes)


def busy_peer(num_tokens: int, graph_mode: int = dp.GRAPH_EAGER, uniform: int = 0):
    """A peer that has `num_tokens` of work in every phase of every step."""
    def peers(local: dp.LocalDispatch) -> list[dp.LocalDispatch]:
        return [dp.LocalDispatch(local.step_id, local.phase, dp.STATUS_OK, num_tokens, graph_mode, uniform, 1)]
    return peers


def engine_model_and_drafter(cfg, groups):
    """`EngineConfig.model_factory` for the fakes: "runner_fsm.testing.fakes:engine_model_and_drafter"."""
    drafter = FakeDrafter(cfg.num_speculative_tokens) if cfg.num_speculative_tokens else None
    return FakeModel(groups.pcp if groups else None), drafter
