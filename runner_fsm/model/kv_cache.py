"""The paged KV cache of one model on one rank: `num_blocks` blocks of `block_size` slots.

PCP does not shard it: every PCP rank writes every new token of the step. One extra slot past
the last block absorbs the writes of rows whose slot is `PAD_SLOT_ID`, so a write has a fixed
shape (capturable in a graph) and still leaves every real block untouched.
"""

from __future__ import annotations

import torch

from runner_fsm.errors import BatchError
from runner_fsm.pcp.kv import PAD_SLOT_ID


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 1 or block_size < 1:
            raise BatchError(f"a KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.trash_slot = self.num_slots  # where PAD_SLOT_ID rows write
        shape = (num_layers, self.num_slots + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v [G, Hkv, d] at `slots` [G]; `PAD_SLOT_ID` rows go to the trash slot."""
        target = torch.where(slots == PAD_SLOT_ID, torch.full_like(slots, self.trash_slot), slots)
        self.k[layer].index_copy_(0, target, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, target, v.to(self.v.dtype))

    def check_slots(self, slots: torch.Tensor, where: str) -> None:
        """Eager-only (reads the slots on the host): every slot is a real one or PAD_SLOT_ID."""
        bad = (slots != PAD_SLOT_ID) & ((slots < 0) | (slots >= self.num_slots))
        if bool(bad.any()):
            first = int(slots[bad][0])
            raise BatchError(f"{where}: slot {first} lies outside the KV cache of"
                             f" {self.num_blocks} blocks x {self.block_size} slots")

    def block_slots(self, block_table: torch.Tensor, num_positions: int | None = None) -> torch.Tensor:
        """Slots of positions 0.. of one or more block-table rows ([B] -> [L], [n, B] -> [n, L])."""
        width = block_table.shape[-1] * self.block_size
        length = width if num_positions is None else num_positions
        pos = torch.arange(length, device=block_table.device)
        blocks = block_table.long().index_select(-1, pos // self.block_size)
        return blocks * self.block_size + pos % self.block_size
