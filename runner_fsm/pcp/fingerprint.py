"""The fingerprint of a persistent buffer (no torch import: the replay tool reads these)."""

from __future__ import annotations

from typing import NamedTuple


class BufferFingerprint(NamedTuple):
    """Address, shape and write count of one buffer; equal fingerprints mean untouched.

    A NamedTuple rather than a frozen dataclass: one is built per buffer on every step.
    """

    ptr: int
    shape: tuple[int, ...]
    version: int
