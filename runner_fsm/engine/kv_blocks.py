"""Paged KV blocks of one replica: a free list, allocated and freed per request."""

from __future__ import annotations

from runner_fsm.errors import ConfigError


class BlockAllocator:
    """Hands out block ids in [0, num_blocks); lowest ids first, so runs are reproducible."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields the lowest id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, or None (nothing taken) when too few are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(sorted(blocks)))
        self._free.sort(reverse=True)
