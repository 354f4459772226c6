"""Fingerprints of vLLM's persistent input buffers, taken right before every target forward.

A forward (or a graph replay) reads vLLM's persistent buffers: `input_ids`, `positions`,
`query_start_loc`, `seq_lens`, and the block table and slot mapping of KV group 0. What a
dummy forward or a replay reads there is whatever the last writer left, so per forward the
journal keeps each buffer's content hash of the bytes read (`inputs`), and the audit log's
`buffers` record the attention metadata that must be fresh (`JUDGED`): its address and storage
rows (`shape`: a graph reads the storage it was captured on), the rows read, a write stamp
(`version`) and the content hash (`digest`).

vLLM writes most of these buffers through numpy views, which never move torch's in-place
counter, so `version` is the runner adapter's count of the runner's input preparations
(`ForwardInputs.stamp`): a forward whose stamp did not move reads inputs written for another.
Equal bytes alone prove nothing (two idle dummies in a row are equal and both fresh); the
digest still tells a dummy that holds the last real batch's bytes. Hashes are cheap on purpose
(the audit must cost < 100 us a step):
- CPU: crc32 of the bytes read (the buffers are contiguous: no copy);
- accelerator: a position-weighted sum on the device (one small kernel per buffer, no host
  sync); the values are copied to the host after the step, when the record is written.
"""

from __future__ import annotations

import zlib
from collections import namedtuple
from typing import Any

import torch

from runner_fsm.audit.render import BuffersTemplate, dumps_record
from runner_fsm.integrations.vllm.runners import NAMES, TOKEN_BUFFERS, ForwardInputs
from runner_fsm.pcp.buffers import pending_device_digest

# The attention metadata a forward must find freshly written, real or dummy: two real steps
# never share them (sequence lengths grow, KV slots differ), vLLM's dummy run writes its own
# (-1 slots, its own lengths). A graph replay that finds them unchanged replays the previous
# batch's attention (the idle-dummy bug). The other buffers may legitimately repeat between
# steps (the same requests' block rows and query offsets, the same token twice), so they are
# logged for diagnosis, not judged.
JUDGED = ("slot_mapping", "seq_lens")


# Per judged buffer: its index in NAMES, whether it has a row per token (two: `resolve` fills
# them in without a loop).
_JUDGED_AT = tuple((NAMES.index(name), name in TOKEN_BUFFERS) for name in JUDGED)
assert len(_JUDGED_AT) == 2, "resolve() renders two judged buffers"
# The `buffers` record of a forward: the judged buffers' (ptr, [rows], version=content hash).
JUDGED_RECORD = BuffersTemplate(JUDGED)

# The content hashes of one forward's inputs, by name (the journal's `inputs`): a namedtuple made
# with `tuple.__new__` (a C call, where a dict of six would be built per forward); the journal
# renders it as {name: hash} when it renders its batch (`journal._default`, `_asdict`).
InputHashes = namedtuple("InputHashes", NAMES)
_new_hashes = tuple.__new__

# One forward's fingerprints, as `take` returns them: (the buffers' addresses and storage rows
# in `NAMES` order, the tokens and the requests the forward read, one content hash per buffer:
# ints on the CPU, 0-d device tensors on an accelerator until `resolve`, the write stamp). A
# plain tuple: one is made per forward.
Taken = tuple[tuple[int, ...], tuple[int, ...], int, int, list, int]


class InputProbe:
    """Takes the fingerprints of one forward; `resolve` turns them into audit-record values."""

    def __init__(self):
        self._key = None  # what the cached views belong to (`ForwardInputs.key`)
        self._ptrs: tuple[int, ...] = ()
        self._sizes: tuple[int, ...] = ()
        # Per buffer (bytes of the whole buffer, bytes per row, per token, extra rows); on an
        # accelerator the tensor itself instead of the bytes.
        self._views: list[tuple[Any, int, bool, int]] = []
        self._on_device = False
        # The CPU slices of the last (tokens, requests) read: views of the live bytes, so they
        # serve every forward of that size (each decode step of a steady batch) unchanged.
        self._rows: tuple[int, int] | None = None
        self._slices: list[memoryview] = []

    def _refresh(self, inputs: ForwardInputs) -> None:
        self._key = inputs.key
        self._rows = None
        buffers = inputs.buffers()
        views = []
        for name in NAMES:
            buf = buffers[name]
            # On the CPU the bytes of the whole buffer as a memoryview, made once, sliced per
            # forward by bytes per row: far cheaper than slicing a tensor or a numpy array.
            if buf.device.type == "cpu":
                view, row = memoryview(buf.numpy()).cast("B"), buf.stride(0) * buf.element_size()
            else:
                view, row = buf, 1
            views.append((view, row, name in TOKEN_BUFFERS, int(name == "query_start_loc")))
        self._views = views
        self._sizes = tuple(int(buffers[name].shape[0]) for name in NAMES)  # rows of each storage
        self._ptrs = tuple(buffers[name].data_ptr() for name in NAMES)
        self._on_device = any(buf.device.type != "cpu" for buf in buffers.values())

    def take(self, inputs: ForwardInputs, args: dict) -> tuple[Taken | None, list[str]]:
        """(the fingerprints of what the forward reads, as the runner adapter names it; names
        of forward inputs that are not the persistent buffers, i.e. copies a graph replay would
        never see)."""
        if inputs.key is not self._key:
            self._refresh(inputs)
        num_tokens, num_reqs = inputs.num_tokens, inputs.num_reqs
        if self._on_device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None, []  # a kernel launched now would become part of the captured graph
            hashes = [pending_device_digest(view[:num_tokens if per_token else num_reqs + extra])
                      for view, _, per_token, extra in self._views]
        else:
            if self._rows != (num_tokens, num_reqs):
                self._rows = (num_tokens, num_reqs)
                self._slices = [view[:(num_tokens if per_token else num_reqs + extra) * row]
                                for view, row, per_token, extra in self._views]
            crc32, hashes = zlib.crc32, []  # a plain loop: cheaper cold than map() or a listcomp
            for view in self._slices:
                hashes.append(crc32(view))
        copied = []
        ptrs = self._ptrs
        for name, index in (("input_ids", 0), ("positions", 1)):
            arg = args.get(name)
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != ptrs[index]:
                copied.append(name)
        return (ptrs, self._sizes, num_tokens, num_reqs, hashes, inputs.stamp), copied


def resolve(taken: Taken, reason: str, copied: list[str] | None = None,
            graph_tokens: int | None = None) -> tuple[InputHashes, bytes]:
    """(the content hash of each input by name, the fields of the forward's `buffers` record: per
    judged buffer its address, storage rows (`shape`), write stamp (`version`), content hash
    (`digest`) and rows read, see `JUDGED_RECORD`; then `copied` (inputs the forward was
    handed as copies, not the persistent buffers) and `graph_tokens` (the size of the graph a
    replay or capture runs) when given). Device hashes are copied to the host here, once per
    forward (after the step, never before a replay)."""
    ptrs, sizes, num_tokens, num_reqs, hashes, stamp = taken
    if hashes and type(hashes[0]) is not int:  # device digests (0-d tensors): all or none
        hashes = torch.stack(hashes).tolist()
    (a, a_per_token), (b, b_per_token) = _JUDGED_AT
    values = (ptrs[a], sizes[a], stamp, hashes[a], num_tokens if a_per_token else num_reqs,
              ptrs[b], sizes[b], stamp, hashes[b], num_tokens if b_per_token else num_reqs)
    extra = b""
    if copied:
        extra += b',"copied":' + dumps_record(list(copied))
    if graph_tokens is not None:
        extra += b',"graph_tokens":%d' % graph_tokens
    return _new_hashes(InputHashes, hashes), JUDGED_RECORD.body(reason, values, extra)
