"""Evidence from vLLM MRV2's PCP manager (`vllm/v1/worker/gpu/pcp_manager.py`), per forward.

Under PCP (`runner.pcp_manager` is not None) the manager owns what a forward's attention reads:
the rank-local batch in its own persistent `InputBuffers`, the gathered KV slot mappings, and
the layout of the step's partition (`_hidden_restore_idx`, built by `partition_batch`). Replay
judges these with the embedded engine's rules (`rules.checks`), so they are logged in the
records those rules read (`replay.scan`):

- the dispatch count: the inputs of `get_num_tokens_for_dispatch` go on the TARGET agreement's
  `enqueue` record (`inputs`) next to the count vLLM sent (`sent.num_tokens`):
  `dispatch_mismatch` recomputes it;
- the PCP attention context: the forward's `expert`/`forward` record carries `ctx`, the
  identity of the context it reads (the step it was built for, dummy or real, rows, and the
  digest of its arrays as the forward reads them: restore index, slot mappings, query lengths),
  and `batch`, the identity of the step's own batch (the digest of the layout as it was built
  for a real batch; of the dummy's defined layout, every slot `PAD_SLOT_ID`, for a dummy):
  `stale_context` compares them. A context is "built" where vLLM builds it: `prepare_attn`
  (real), `get_dummy_slot_mappings` (dummy); a forward that reads anything else reads the
  context of the last build;
- the persistent PCP buffers the forward reads: a `buffers` record written right before the
  forward (torch's write counter as `version`: the manager writes them with torch ops only, and
  crc32 of the rows read as `digest`): `stale_buffer_replay` (`stale_inputs`) judges them.

The cost is a few crc32 over small arrays per forward, on the host; on an accelerator the
digests are left out (None), since reading device memory here would sync.

The injected faults of `inject` that act on the manager are applied here too, as the bug they
reproduce would (no record of them is written here; replay finds them from the evidence).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import numpy as np
import torch

from runner_fsm.integrations.vllm.common import schema, versions
from runner_fsm.integrations.vllm.runners.base import wrap_method
from runner_fsm.rules.checks import dispatch_inputs

PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils.PAD_SLOT_ID: a token whose KV is not written
CHUNKING = "mrv2"  # runner_fsm.pcp.plan's policy that is MRV2's partition
BUFFERS = ("input_ids", "positions", "query_start_loc", "seq_lens")
# The manager's staging of a capture or dummy batch in its persistent buffers, by release:
# vLLM 0.33 renamed it and expands the batch's padding mask to the rows the MoE routes there
# (`moe_is_padding`, into `_moe_is_padding`; vllm/v1/worker/gpu/pcp_manager.py:735-763 in 0.33.0).
CAPTURE_PREPARATION = {"0.32.0": ("prepare_inputs_to_capture", ()),
                       "0.33.0": ("prepare_inputs_for_capture_or_profile", ("moe_is_padding", "_moe_is_padding"))}
_COMMON_NAMES = ("pcp_world_size", "shard_decode_requests", "get_num_tokens_for_dispatch", "get_dummy_slot_mappings",
                 "_hidden_restore_idx", "_gathered_kv_slot_mappings", *(f"input_buffers.{name}" for name in BUFFERS))


def manager_names(version: str | None = None) -> tuple[str, ...]:
    """Every name read from the PCP manager (vLLM's `PCPManager`, vLLM-Ascend's `AscendPCPManager`)
    on `version` (default: the installed vLLM); tests/test_vllm_ascend_source.py resolves each on
    the manager vLLM-Ascend's runner builds."""
    name, more = versions.pick(CAPTURE_PREPARATION, schema.installed_version() if version is None else version)
    return (*_COMMON_NAMES, name, *more)


MANAGER_NAMES = manager_names("0.32.0")  # vLLM 0.32's (the CPU build's), for the tests that read it


def layout_digest(restore_idx: Any, slot_mapping: Any, query_lens: Any) -> int | None:
    """crc32 over a rank's partition: restore index (None for a dummy), its slot mappings
    (KV group 0), its per-request query lengths; None where an array is not on the host."""
    crc = 0
    for array, dtype in ((restore_idx, np.int64), (slot_mapping, np.int64), (query_lens, np.int32)):
        if array is None:
            continue
        if isinstance(array, torch.Tensor):
            if array.device.type != "cpu":
                return None
            array = array.numpy()
        crc = zlib.crc32(np.ascontiguousarray(array, dtype=dtype), crc)
    return crc


def dummy_layout_digest(num_tokens: int, pcp_size: int, query_lens: Any) -> int | None:
    """The digest a dummy's own context has: no restore index, every gathered slot PAD."""
    return layout_digest(None, np.full(num_tokens * pcp_size, PAD_SLOT_ID, dtype=np.int64), query_lens)


def _fingerprint(buf: torch.Tensor, rows: int) -> dict:
    view = buf[:rows]
    digest = zlib.crc32(view.numpy()) if view.device.type == "cpu" and view.is_contiguous() else None
    return {"ptr": buf.data_ptr(), "shape": [rows], "version": buf._version, "digest": digest}


class PCPEvidence:
    """Wraps one PCP manager instance (its class and other instances untouched)."""

    def __init__(self, manager: Any, step_of: Callable[[], int], fault_due: Callable[[str], bool] | None = None):
        self.manager = manager
        self.pcp_size = int(manager.pcp_world_size)
        self._step_of = step_of
        self._due = fault_due or (lambda _kind: False)
        self._dispatch: tuple[int, dict] | None = None  # (step, inputs) of the last dispatch count
        self._built: dict | None = None  # {step, dummy, rows} of the context built last
        self._batch: dict | None = None  # the identity of the step's own batch
        self._forward: tuple | None = None  # (batch, slot mappings) handed to the next forward
        self._last_real_slots: torch.Tensor | None = None
        wrap_method(manager, "get_num_tokens_for_dispatch", self._dispatch_count)
        # the installed release's name (`manager_names` checked it exists: the runner adapter's `problems`)
        self._capture_name = next(name for name, _ in CAPTURE_PREPARATION.values() if hasattr(manager, name))
        wrap_method(manager, self._capture_name, self._stage_dummy)
        wrap_method(manager, "get_dummy_slot_mappings", self._dummy_slots)

    # -- the dispatch count

    def _dispatch_count(self, count, args, kwargs):
        num_scheduled, is_prefilling = args if len(args) == 2 else (
            kwargs.get("num_scheduled_tokens", args[0] if args else None), kwargs.get("is_prefilling"))
        n = count(*args, **kwargs)
        self._dispatch = (self._step_of(), dispatch_inputs(
            num_scheduled, is_prefilling, self.pcp_size, CHUNKING,
            per_decode=bool(getattr(self.manager, "shard_decode_requests", False))))
        if self._due("wrong-dispatch-count"):
            return int(np.asarray(num_scheduled).sum())  # injected: the global count, not the local one
        return n

    def agreement_extra(self, step: int) -> dict:
        """For this step's TARGET agreement record: the inputs of the count it sends."""
        taken, self._dispatch = self._dispatch, None
        if taken is None or taken[0] != step:
            return {}
        return {"inputs": taken[1]}

    # -- contexts and batches

    def real_prepared(self, batch: Any, slot_mappings: torch.Tensor) -> None:
        """`prepare_attn` built the context of this step's real (PCP-local) batch."""
        step, rows = self._step_of(), int(batch.num_tokens_after_padding)
        self._built = {"step": step, "dummy": False, "rows": rows}
        self._last_real_slots = slot_mappings
        digest = layout_digest(self.manager._hidden_restore_idx, slot_mappings[0], batch.num_scheduled_tokens)
        self._batch = {"step": step, "dummy": False, "rows": rows, "digest": digest}
        self._forward = (batch, slot_mappings)

    def dummy_prepared(self, batch: Any, slot_mappings: torch.Tensor) -> None:
        """`prepare_dummy_attn` returned what the dummy forward reads."""
        self._forward = (batch, slot_mappings)

    def _stage_dummy(self, stage, args, kwargs):
        batch = args[0] if args else kwargs["input_batch"]
        rows = int(batch.num_tokens)
        self._batch = {"step": self._step_of(), "dummy": True, "rows": rows,
                       "digest": dummy_layout_digest(rows, self.pcp_size, batch.num_scheduled_tokens)}
        if self._due("skip-buffer-refresh"):
            # Injected: the dummy's views point at the PCP buffers as the last real batch left them.
            bufs, n, r = self.manager.input_buffers, batch.num_tokens_after_padding, batch.num_reqs_after_padding
            return dataclasses.replace(batch, input_ids=bufs.input_ids[:n], positions=bufs.positions[:n],
                                       is_padding=self._stale_padding(bufs, n),
                                       query_start_loc=bufs.query_start_loc[:r + 1], seq_lens=bufs.seq_lens[:r])
        return stage(*args, **kwargs)

    def _stale_padding(self, bufs, n: int):
        """The padding mask the dummy's forward reads, as the last real batch left it: on vLLM 0.33
        with an MoE that gathers tokens, the expanded mask (`_moe_is_padding`, PCP x n rows, which
        the real batch wrote: pcp_manager.py:630 in 0.33.0), else the manager's own `is_padding`."""
        expanded = getattr(self.manager, "_moe_is_padding", None)
        if expanded is not None:
            return expanded[:self.pcp_size * int(n)]
        return bufs.is_padding[:n]

    def _dummy_slots(self, dummy_slots, args, kwargs):
        num_tokens = int(args[0] if args else kwargs["num_tokens"])
        if self._last_real_slots is not None and self._due("stale-pcp-context"):
            # Injected: the dummy reads the slot mappings the last real batch left (no PAD fill).
            return self.manager._gathered_kv_slot_mappings[:, :num_tokens * self.pcp_size]
        self._built = {"step": self._step_of(), "dummy": True, "rows": num_tokens}
        return dummy_slots(*args, **kwargs)

    # -- per forward

    def forward_evidence(self) -> tuple[dict | None, dict] | None:
        """(the PCP buffers' fingerprints, {ctx, batch}) of the forward about to run; None
        outside a prepared forward (profiling)."""
        prepared, self._forward = self._forward, None
        if prepared is None or self._built is None or self._batch is None:
            return None
        batch, slots = prepared
        built = self._built
        restore = None if built["dummy"] else self.manager._hidden_restore_idx
        ctx = dict(built, digest=layout_digest(restore, slots[0], batch.num_scheduled_tokens))
        tokens, reqs = int(batch.num_tokens_after_padding), int(batch.num_reqs_after_padding)
        bufs = self.manager.input_buffers
        rows = {"input_ids": tokens, "positions": tokens, "query_start_loc": reqs + 1, "seq_lens": reqs}
        fingerprints = {f"pcp.{name}": _fingerprint(getattr(bufs, name), rows[name]) for name in BUFFERS}
        gathered = self.manager._gathered_kv_slot_mappings
        if gathered is not None:
            fingerprints["pcp.slot_mapping"] = _fingerprint(gathered[0], int(slots.shape[-1]))
        return fingerprints, {"ctx": ctx, "batch": dict(self._batch)}
