"""The fingerprint of a persistent buffer (no torch import: the replay tool reads these)."""

from __future__ import annotations

from typing import NamedTuple


class BufferFingerprint(NamedTuple):
    """Address, shape, write count and (when asked for) content hash of one buffer.

    A NamedTuple rather than a frozen dataclass: one is built per buffer on every step.
    The write count alone cannot tell a refresh from `buf.copy_(buf)`; the digest (crc32 of
    the bytes) can, so fingerprints that go into the audit log carry it.
    """

    ptr: int
    shape: tuple[int, ...]
    version: int
    digest: int | None = None
