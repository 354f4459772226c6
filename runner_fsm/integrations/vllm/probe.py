"""Fingerprints of vLLM's persistent input buffers, taken right before every target forward.

A forward (or a graph replay) reads vLLM's persistent buffers: `input_ids`, `positions`,
`query_start_loc`, `seq_lens`, and the block table and slot mapping of KV group 0. What a
dummy forward or a replay reads there is whatever the last writer left, so the log keeps,
per forward, each buffer's address, the length read and a content hash of those bytes.

vLLM writes most of these buffers through numpy views, which never move torch's in-place
counter, so `version` would say nothing here: the `version` field of the audit record carries
the content hash instead (equal hash = same bytes; the replay's stale check compares exactly
that). Hashes are cheap on purpose (the audit must cost < 100 us a step):
- CPU: crc32 of the bytes read (the buffers are contiguous: no copy);
- accelerator: a position-weighted sum on the device (one small kernel per buffer, no host
  sync); the values are copied to the host after the step, when the record is written.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

# Token-indexed buffers read one row per token, the others one row per request.
TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")
REQUEST_BUFFERS = ("query_start_loc", "seq_lens", "block_table")
# The attention metadata a forward must find freshly written, real or dummy: two real steps
# never share them (sequence lengths grow, KV slots differ), vLLM's dummy run writes its own
# (-1 slots, its own lengths). A graph replay that finds them unchanged replays the previous
# batch's attention (the idle-dummy bug). The other buffers may legitimately repeat between
# steps (the same requests' block rows and query offsets, the same token twice), so they are
# logged for diagnosis, not judged.
JUDGED = ("seq_lens", "slot_mapping")


def _tensor(buf: Any) -> torch.Tensor:
    """A CpuGpuBuffer's device tensor (on the CPU it aliases `.cpu`), or the tensor itself."""
    return buf if isinstance(buf, torch.Tensor) else buf.gpu


def persistent_buffers(runner: Any) -> dict[str, torch.Tensor]:
    """The runner's persistent forward inputs, looked up each time (vLLM may rebuild its
    input batch when it sizes the KV cache)."""
    table = runner.input_batch.block_table[0]
    return {
        "input_ids": _tensor(runner.input_ids), "positions": _tensor(runner.positions),
        "slot_mapping": _tensor(table.slot_mapping),
        "query_start_loc": _tensor(runner.query_start_loc), "seq_lens": _tensor(runner.seq_lens),
        "block_table": _tensor(table.block_table),
    }


class InputProbe:
    """Takes the fingerprints of one forward; `resolve` turns them into audit-record values."""

    def __init__(self, runner: Any):
        self.runner = runner
        self._weights: torch.Tensor | None = None  # device hash weights, made on first use

    def take(self, num_tokens: int, num_reqs: int, args: dict) -> tuple[dict, list[str]]:
        """({name: (ptr, shape, hash or device scalar)}, names of forward inputs that are not
        the persistent buffers, i.e. copies a graph replay would never see)."""
        bufs = persistent_buffers(self.runner)
        out = {}
        for name, buf in bufs.items():
            rows = num_tokens if name in TOKEN_BUFFERS else num_reqs + (name == "query_start_loc")
            view = buf[:rows]
            out[name] = (buf.data_ptr(), rows, self._hash(view))
        copied = [name for name in ("input_ids", "positions")
                  if isinstance(args.get(name), torch.Tensor) and args[name].data_ptr() != bufs[name].data_ptr()]
        return out, copied

    def _hash(self, view: torch.Tensor):
        if view.device.type == "cpu":
            return zlib.crc32(view.numpy())
        flat = view.reshape(-1).to(torch.int64)
        if self._weights is None or self._weights.numel() < flat.numel() or self._weights.device != flat.device:
            gen = torch.Generator(device="cpu").manual_seed(0x5EED)
            size = max(flat.numel(), 1 << 16)
            self._weights = torch.randint(1, 1 << 62, (size,), generator=gen, dtype=torch.int64).to(flat.device)
        return (flat * self._weights[:flat.numel()]).sum()  # stays on the device until resolve()


def resolve(taken: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """Audit-record values {name: {ptr, shape, version=content hash}}: (inputs, judged
    attention metadata). Device hashes are copied to the host here, once per forward (after
    the step, never before a replay)."""
    pending = [(name, h) for name, (_, _, h) in taken.items() if isinstance(h, torch.Tensor)]
    host = dict(zip((n for n, _ in pending), torch.stack([h for _, h in pending]).tolist())) if pending else {}
    inputs, judged = {}, {}
    for name, (ptr, rows, h) in taken.items():
        (judged if name in JUDGED else inputs)[name] = {"ptr": ptr, "shape": [rows],
                                                        "version": int(host[name] if name in host else h)}
    return inputs, judged
