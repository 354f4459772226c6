"""Fingerprints of vLLM's persistent input buffers, taken right before every target forward.

A forward (or a graph replay) reads vLLM's persistent buffers: `input_ids`, `positions`,
`query_start_loc`, `seq_lens`, and the block table and slot mapping of KV group 0. What a
dummy forward or a replay reads there is whatever the last writer left, so the log keeps,
per forward, each buffer's content hash of the bytes read; the attention metadata that must be
fresh (`JUDGED`) goes into the audit log's `buffers` record with its address and length, the
other hashes into the journal.

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

from runner_fsm.pcp.buffers import pending_device_digest
from runner_fsm.pcp.fingerprint import BufferFingerprint

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
    """The runner's persistent forward inputs."""
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
        self._batch = None  # the input batch the cached views belong to (vLLM may rebuild it)
        self._views: list[tuple[str, bool, int, Any]] = []  # (name, per token, ptr, array or tensor)
        self._on_device = False

    def _refresh(self) -> None:
        self._batch = self.runner.input_batch
        views = []
        for name, buf in persistent_buffers(self.runner).items():
            # On the CPU the bytes of the whole buffer as a memoryview, made once, sliced per
            # forward by bytes per row: far cheaper than slicing a tensor or a numpy array.
            if buf.device.type == "cpu":
                view, row = memoryview(buf.numpy()).cast("B"), buf[:1].numel() * buf.element_size()
            else:
                view, row = buf, 1
            views.append((name, name in TOKEN_BUFFERS, buf.data_ptr(), view, row))
        self._views = views
        self._on_device = any(isinstance(view, torch.Tensor) for _, _, _, view, _ in views)

    def take(self, num_tokens: int, num_reqs: int, args: dict) -> tuple[dict, list[str]]:
        """({name: (ptr, rows, hash or device scalar)}, names of forward inputs that are not
        the persistent buffers, i.e. copies a graph replay would never see)."""
        if self.runner.input_batch is not self._batch:
            self._refresh()
        if self._on_device and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None, []  # a kernel launched now would become part of the captured graph
        out = {}
        if self._on_device:
            for name, per_token, ptr, view, _ in self._views:
                rows = num_tokens if per_token else num_reqs + (name == "query_start_loc")
                out[name] = (ptr, rows, pending_device_digest(view[:rows]))
        else:
            crc32 = zlib.crc32
            for name, per_token, ptr, view, row in self._views:
                rows = num_tokens if per_token else num_reqs + (name == "query_start_loc")
                out[name] = (ptr, rows, crc32(view[:rows * row]))
        copied = []
        for name, index in (("input_ids", 0), ("positions", 1)):
            arg = args.get(name)
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != self._views[index][2]:
                copied.append(name)
        return out, copied


def resolve(taken: dict) -> tuple[dict[str, int], dict[str, BufferFingerprint]]:
    """({name: content hash} of the inputs, audit-record values (ptr, shape, version=content
    hash) of the judged attention metadata; the audit log's fast path takes the tuple type). Device hashes are copied to
    the host here, once per forward (after the step, never before a replay)."""
    host = {}
    if taken and isinstance(next(iter(taken.values()))[2], torch.Tensor):  # device digests: all or none
        host = dict(zip(taken, torch.stack([h for _, _, h in taken.values()]).tolist()))
    inputs, judged = {}, {}
    for name, (ptr, rows, h) in taken.items():
        value = int(host[name]) if host else h
        if name in JUDGED:
            judged[name] = BufferFingerprint(ptr, (rows,), value)
        else:
            inputs[name] = value
    return inputs, judged
