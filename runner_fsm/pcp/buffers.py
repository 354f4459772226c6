"""Persistent input buffers: allocated once at capacity, rewritten in place every step.

A captured graph reads these tensors by address, so their storage never moves: every write
is a ``copy_``/``fill_`` into a slice, never a rebinding. Each in-place write bumps the
tensor's version counter (``tensor._version``, shared by views with their base), which the
audit log records and the stale-buffer check compares: a replay after a step that did not
move the versions would read the previous batch.
"""

from __future__ import annotations

import zlib
from typing import Mapping, Sequence

import numpy as np
import torch

from runner_fsm.config import RunnerConfig
from runner_fsm.errors import BatchError
from runner_fsm.pcp.arrays import int_array
from runner_fsm.pcp.fingerprint import BufferFingerprint
from runner_fsm.pcp.kv import PAD_SLOT_ID
from runner_fsm.pcp.plan import PCPPlan, RankBatch

BUFFER_NAMES = (
    "input_ids",
    "positions",
    "is_padding",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "gathered_slot_mapping",
    "is_replicated",
)

_INT32_MAX = np.iinfo(np.int32).max


def stale_buffers(
    before: Mapping[str, BufferFingerprint], after: Mapping[str, BufferFingerprint]
) -> tuple[str, ...]:
    """Names of the buffers a write did not touch (version unchanged)."""
    return tuple(name for name in before if after[name].version == before[name].version)


def content_digest(buf: np.ndarray | torch.Tensor) -> int:
    """crc32 of the bytes of a host array (or CPU tensor); for a tensor on an accelerator, a
    position-weighted sum computed on the device (no copy to the host every step)."""
    if isinstance(buf, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(buf))
    if buf.device.type == "cpu":
        return zlib.crc32(buf.contiguous().numpy())
    return device_digest(buf)


def device_digest(buf: torch.Tensor) -> int:
    """sum(value_i * w_i) mod 2**64 with fixed odd weights: any change of one value, and any
    swap of two different values, changes it (torch.hash_tensor's xor would miss the swap)."""
    return int(pending_device_digest(buf).item()) & 0xFFFFFFFFFFFFFFFF


def pending_device_digest(buf: torch.Tensor) -> torch.Tensor:
    """`device_digest` as a 0-d tensor left on the device: a caller that must not sync the
    host before a graph replay (the vLLM worker) reads many of these at once after the step."""
    values = buf.reshape(-1).to(torch.int64)
    return (values * _weights(values.numel(), values.device)).sum()


_WEIGHTS: dict = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    found = _WEIGHTS.get(device)
    if found is None or found.numel() < n:
        gen = torch.Generator().manual_seed(0x5EED)
        found = torch.randint(-(2**62), 2**62, (max(n, 1024),), generator=gen, dtype=torch.int64)
        found = (found | 1).to(device)
        _WEIGHTS[device] = found
    return found[:n]


def _fits_int32(name: str, arr: np.ndarray) -> None:
    if arr.size and (arr.max() > _INT32_MAX or arr.min() < -_INT32_MAX - 1):
        raise BatchError(f"{name} holds {arr.max()}, beyond the int32 range of its buffer")


def _copy_whole(buf: torch.Tensor, head: np.ndarray, dtype: type, fill: int) -> None:
    """`buf` := `head`, then `fill` to its end, in one copy."""
    whole = np.full(buf.shape[0], fill, dtype=dtype)
    whole[: head.shape[0]] = head
    buf.copy_(torch.from_numpy(whole))


def dummy_query_lens(num_reqs: int, num_tokens: int) -> np.ndarray:
    """Split ``num_tokens`` dummy rows over ``num_reqs`` requests; the last takes the rest."""
    if num_tokens == 0 and num_reqs != 0:
        raise BatchError(f"a dummy of 0 tokens has 0 requests, got num_reqs={num_reqs}")
    if num_tokens > 0 and not 1 <= num_reqs <= num_tokens:
        raise BatchError(
            f"a dummy of {num_tokens} tokens needs 1..{num_tokens} requests, got {num_reqs}"
        )
    lens = np.full(num_reqs, num_tokens // max(num_reqs, 1), dtype=np.int64)
    if num_reqs:
        lens[-1] += num_tokens - int(lens.sum())
    return lens


class PersistentBuffers:
    """Rank-local step inputs at fixed addresses; capacities come from ``RunnerConfig``."""

    def __init__(self, config: RunnerConfig, device: torch.device | str = "cpu") -> None:
        config.validate()
        self.device = torch.device(device)
        self.pcp_size = config.layout.pcp_size
        self.max_num_tokens = config.max_num_tokens  # rank-local rows
        self.max_num_segments = config.num_segments
        self.max_blocks_per_req = config.max_blocks_per_req
        rows, segs, dev = self.max_num_tokens, self.max_num_segments, self.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.is_padding = torch.ones(rows, dtype=torch.bool, device=dev)
        # A row whose token is on every PCP rank (a decode row): its experts run once.
        self.is_replicated = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.query_start_loc = torch.zeros(segs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(segs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(
            segs, self.max_blocks_per_req, dtype=torch.int32, device=dev
        )
        self.gathered_slot_mapping = torch.full(
            (self.pcp_size * rows,), PAD_SLOT_ID, dtype=torch.int64, device=dev
        )
        # What the last write put there (0 before any write).
        self.num_tokens = 0  # N: rows this rank executes
        self.num_segments = 0
        self.is_dummy = False
        self._rows_high = self._segments_high = 0  # the furthest any write reached
        self._views = None  # (tensors, their host views) for content digests

    # -- public writes ----------------------------------------------------------------

    def write_real(
        self,
        plan: PCPPlan,
        rank: int,
        input_ids_global: Sequence[int] | np.ndarray,
        block_tables: np.ndarray,
        gathered_slots: Sequence[int] | np.ndarray,
    ) -> None:
        """Write PCP rank ``rank``'s rows of ``plan``; everything is checked before any write."""
        ids, tables, slots = self._check_real(
            plan, rank, input_ids_global, block_tables, gathered_slots
        )
        rb = plan.ranks[rank]
        self._write_rows(ids[rb.token_idx], rb.positions, plan.replicated_rows(rank))
        self._write_segments(rb.query_start_loc, rb.seq_lens, tables[rb.seg_req_idx])
        self._write_slots(slots)
        self._record(plan.num_tokens_padded, rb.num_segments, is_dummy=False)

    def write_dummy(self, num_reqs: int, num_tokens: int) -> None:
        """Write a dummy of ``num_tokens`` padding rows in ``num_reqs`` requests.

        Zeroed block tables and ``PAD_SLOT_ID`` everywhere: the dummy writes no K/V, and no
        row of the previous real batch survives.
        """
        self._check_capacity(num_tokens, num_reqs, what="dummy")
        lens = dummy_query_lens(num_reqs, num_tokens)
        empty = np.zeros(0, dtype=np.int64)
        self._write_rows(empty, empty, np.zeros(0, dtype=bool))
        query_start_loc = np.concatenate([[0], np.cumsum(lens)])
        # Positions are all 0, so a dummy request's causal keys are just its own rows.
        self._write_segments(query_start_loc, lens, np.zeros((num_reqs, 0), dtype=np.int64))
        self._write_slots(empty)
        self._record(num_tokens, num_reqs, is_dummy=True)

    def _record(self, num_tokens: int, num_segments: int, *, is_dummy: bool) -> None:
        self.num_tokens = int(num_tokens)
        self.num_segments = int(num_segments)
        self.is_dummy = is_dummy
        self._rows_high = max(self._rows_high, self.num_tokens)
        self._segments_high = max(self._segments_high, self.num_segments)

    def fingerprint(self, *, content: bool = False) -> dict[str, BufferFingerprint]:
        """Address, shape and write count of every buffer (read on every step: kept lean);
        with `content`, also a hash of the bytes each one holds (what the audit log records)."""
        if not content:
            return {name: BufferFingerprint(buf.data_ptr(), tuple(buf.shape), buf._version)
                    for name, buf in zip(BUFFER_NAMES, self._buffers())}
        return {name: BufferFingerprint(buf.data_ptr(), tuple(buf.shape), buf._version, content_digest(written))
                for name, buf, written in zip(BUFFER_NAMES, self._buffers(), self._ever_written())}

    def _ever_written(self) -> tuple:
        """Each buffer up to the furthest row any write reached: beyond it every buffer still
        holds its initial fill (every write resets what it does not use to that same fill), so
        hashing this much hashes the whole content, at the cost of the largest batch so far
        rather than of the capacity. `query_start_loc` is filled with the last offset, so it is
        hashed whole (it is small). On the host the numpy views are made once per storage."""
        rows, segs = self._rows_high, self._segments_high
        tensors, views = self._buffers(), self._views
        if views is None or any(a is not b for a, b in zip(views[0], tensors)):  # made, or rebound
            arrays = tuple(t.numpy() for t in tensors) if self.device.type == "cpu" else tensors
            views = self._views = (tensors, arrays)
        ids, pos, pad, qsl, seq, tables, slots, replicated = views[1]
        return (ids[:rows], pos[:rows], pad[:rows], qsl, seq[:segs], tables[:segs],
                slots[:self.pcp_size * rows], replicated[:rows])

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        # Looked up by name each time: a rebound tensor must show up as moved storage.
        return (self.input_ids, self.positions, self.is_padding, self.query_start_loc,
                self.seq_lens, self.block_tables, self.gathered_slot_mapping, self.is_replicated)

    # -- checks (no mutation) ---------------------------------------------------------

    def _check_capacity(self, num_tokens: int, num_segments: int, what: str) -> None:
        for name, value in (("num_tokens", num_tokens), ("num_segments", num_segments)):
            if not isinstance(value, (int, np.integer)):
                raise BatchError(f"{what}: {name} must be an integer, got {value!r}")
        if not 0 <= num_tokens <= self.max_num_tokens:
            raise BatchError(
                f"{what} needs {num_tokens} rank-local rows,"
                f" capacity is max_num_tokens={self.max_num_tokens}"
            )
        if not 0 <= num_segments <= self.max_num_segments:
            raise BatchError(
                f"{what} needs {num_segments} segments,"
                f" capacity is num_segments={self.max_num_segments}"
            )

    def _check_real(
        self,
        plan: PCPPlan,
        rank: int,
        input_ids_global: Sequence[int] | np.ndarray,
        block_tables: np.ndarray,
        gathered_slots: Sequence[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if plan.pcp_size != self.pcp_size:
            raise BatchError(f"plan is for pcp_size={plan.pcp_size}, buffers for {self.pcp_size}")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < plan.pcp_size:
            raise BatchError(f"rank must lie in [0, {plan.pcp_size}), got {rank!r}")
        rb = plan.ranks[rank]
        self._check_capacity(plan.num_tokens_padded, rb.num_segments, what=f"plan rank {rank}")
        ids = int_array("input_ids_global", input_ids_global, 1)
        if ids.shape[0] != plan.num_tokens:
            raise BatchError(
                f"input_ids_global has {ids.shape[0]} entries, the plan has"
                f" {plan.num_tokens} global tokens"
            )
        slots = int_array("gathered_slots", gathered_slots, 1)
        gathered = plan.pcp_size * plan.num_tokens_padded
        if slots.shape[0] != gathered:
            raise BatchError(
                f"gathered_slots has {slots.shape[0]} entries, expected P*N={gathered}"
            )
        tables = self._check_tables(block_tables, rb)
        return ids, tables, slots

    def _check_tables(self, block_tables: np.ndarray, rb: RankBatch) -> np.ndarray:
        tables = int_array("block_tables", block_tables, 2)
        if tables.shape[1] > self.max_blocks_per_req:
            raise BatchError(
                f"block_tables rows have {tables.shape[1]} blocks,"
                f" capacity is max_blocks_per_req={self.max_blocks_per_req}"
            )
        missing = rb.seg_req_idx[rb.seg_req_idx >= tables.shape[0]]
        if missing.size:
            raise BatchError(
                f"request {missing[0]} has no block-table row; block_tables has"
                f" {tables.shape[0]} rows"
            )
        _fits_int32("block_tables", tables)
        _fits_int32("seq_lens", rb.seq_lens)
        return tables

    # -- in-place writes --------------------------------------------------------------

    # Each buffer is assembled whole on the host and written with one copy: a torch op per
    # slice (data, then padding) costs more than the bytes, and on a device one transfer per
    # buffer replaces several small kernels. Every write still moves the buffer's version.

    def _write_rows(self, input_ids: np.ndarray, positions: np.ndarray, replicated: np.ndarray) -> None:
        """Real rows first, every later row padding (id 0, position 0, not replicated)."""
        n, rows = input_ids.shape[0], self.max_num_tokens
        _copy_whole(self.input_ids, input_ids, np.int64, 0)
        _copy_whole(self.positions, positions, np.int64, 0)
        padding = np.ones(rows, dtype=bool)
        padding[:n] = False
        self.is_padding.copy_(torch.from_numpy(padding))
        _copy_whole(self.is_replicated, np.asarray(replicated, dtype=bool), bool, False)

    def _write_segments(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, seg_tables: np.ndarray
    ) -> None:
        """Segments first; later segments are empty (start = end, seq_len 0, zero table)."""
        s, width = seq_lens.shape[0], seg_tables.shape[1]
        _copy_whole(self.query_start_loc, query_start_loc, np.int32, int(query_start_loc[-1]))
        _copy_whole(self.seq_lens, seq_lens, np.int32, 0)
        tables = np.zeros(tuple(self.block_tables.shape), dtype=np.int32)
        tables[:s, :width] = seg_tables
        self.block_tables.copy_(torch.from_numpy(tables))

    def _write_slots(self, slots: np.ndarray) -> None:
        _copy_whole(self.gathered_slot_mapping, slots, np.int64, PAD_SLOT_ID)
