"""The global batch a scheduler gives one replica, and its validation.

Validation runs before anything is mutated: a bad batch raises `BatchError` and leaves
request state, KV cache and persistent buffers untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from runner_fsm.config import RunnerConfig
from runner_fsm.errors import BatchError


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduledBatch:
    """What one replica runs this step; identical on every PCP rank of that replica."""

    req_ids: tuple[str, ...]
    num_scheduled: np.ndarray  # [R] tokens scheduled per request (1 + K for verify rows)
    is_prefilling: np.ndarray  # [R] bool
    num_computed: np.ndarray  # [R] tokens already in the KV cache
    token_ids: np.ndarray  # [T] input ids in global order (request by request)
    block_tables: np.ndarray  # [R, max_blocks] paged-KV block ids
    num_draft_tokens: np.ndarray | None = None  # [R] K verify tokens; None: no drafting
    finished_req_ids: tuple[str, ...] = ()  # requests done since the previous batch
    # New requests whose first num_computed tokens are already cached (prefix caching).
    cached_prefix_req_ids: tuple[str, ...] = ()

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def any_prefill(self) -> bool:
        return bool(self.is_prefilling.any())

    def uniform_query_len(self) -> int:
        """1 + K when every request is a decode of the same length, else 0."""
        if self.num_reqs == 0 or self.any_prefill:
            return 0
        first = int(self.num_scheduled[0])
        return first if bool((self.num_scheduled == first).all()) else 0

    @classmethod
    def build(cls, req_ids, num_scheduled, is_prefilling, num_computed, token_ids, block_tables,
              num_draft_tokens=None, finished_req_ids=(), cached_prefix_req_ids=()) -> "ScheduledBatch":
        """Wrap plain sequences as arrays; call `validate_batch` before using the result."""
        drafts = None if num_draft_tokens is None else np.asarray(num_draft_tokens, dtype=np.int64)
        tables = np.asarray(block_tables, dtype=np.int64)
        if tables.ndim == 1 and tables.size == 0:
            tables = tables.reshape(0, 0)
        return cls(
            req_ids=tuple(str(r) for r in req_ids),
            num_scheduled=np.asarray(num_scheduled, dtype=np.int64),
            is_prefilling=np.asarray(is_prefilling, dtype=bool),
            num_computed=np.asarray(num_computed, dtype=np.int64),
            token_ids=np.asarray(token_ids, dtype=np.int64),
            block_tables=tables,
            num_draft_tokens=drafts,
            finished_req_ids=tuple(str(r) for r in finished_req_ids),
            cached_prefix_req_ids=tuple(str(r) for r in cached_prefix_req_ids),
        )


def validate_batch(batch: ScheduledBatch, config: RunnerConfig, *, num_kv_blocks: int | None = None,
                   where: str = "") -> ScheduledBatch:
    """Raise `BatchError` (naming `where`, e.g. replica and step) for any malformed field."""
    prefix = f"{where}: " if where else ""

    def fail(message: str) -> None:
        raise BatchError(prefix + message)

    r = batch.num_reqs
    arrays = {"num_scheduled": batch.num_scheduled, "is_prefilling": batch.is_prefilling,
              "num_computed": batch.num_computed}
    if batch.num_draft_tokens is not None:
        arrays["num_draft_tokens"] = batch.num_draft_tokens
    for name, arr in arrays.items():
        if arr.ndim != 1 or arr.shape[0] != r:
            fail(f"{name} must have one entry per request ({r}), got shape {arr.shape}")
    if len(set(batch.req_ids)) != r:
        fail(f"request ids must be unique, got {list(batch.req_ids)}")
    # Each check looks for the culprit only once it knows there is one: the common, valid
    # batch pays one reduction per rule.
    for name in ("num_scheduled", "num_computed"):
        if r and arrays[name].min() < 0:
            bad = np.flatnonzero(arrays[name] < 0)
            fail(f"{name} must be >= 0, got {arrays[name][bad[0]]} for request {batch.req_ids[bad[0]]!r}")
    if r and batch.num_scheduled.min() == 0:
        zero = np.flatnonzero(batch.num_scheduled == 0)
        fail(f"request {batch.req_ids[zero[0]]!r} is scheduled with 0 tokens")
    if batch.token_ids.shape != (batch.num_tokens,):
        fail(f"token_ids must hold {batch.num_tokens} ids (the scheduled total), got shape {batch.token_ids.shape}")
    if batch.num_tokens > config.max_num_tokens:
        fail(f"batch schedules {batch.num_tokens} tokens, more than max_num_tokens={config.max_num_tokens}")
    if r > config.max_num_reqs:
        fail(f"batch has {r} requests, more than max_num_reqs={config.max_num_reqs}")
    _validate_drafts(batch, config, fail)
    _validate_blocks(batch, config, num_kv_blocks, fail)
    return batch


def _validate_drafts(batch: ScheduledBatch, config: RunnerConfig, fail) -> None:
    drafts = batch.num_draft_tokens
    if drafts is None:
        return
    if drafts.size and drafts.min() < 0:
        bad = np.flatnonzero(drafts < 0)
        fail(f"num_draft_tokens must be >= 0, got {drafts[bad[0]]} for request {batch.req_ids[bad[0]]!r}")
    on_prefill = np.flatnonzero((drafts > 0) & batch.is_prefilling)
    if on_prefill.size:
        fail(f"request {batch.req_ids[on_prefill[0]]!r} is prefilling but carries"
             f" {drafts[on_prefill[0]]} draft tokens; drafts only ride on decode rows")
    k = config.num_speculative_tokens
    too_many = np.flatnonzero(drafts > k)
    if too_many.size:
        fail(f"request {batch.req_ids[too_many[0]]!r} carries {drafts[too_many[0]]} draft tokens,"
             f" more than num_speculative_tokens={k}")
    mismatch = np.flatnonzero(~batch.is_prefilling & (batch.num_scheduled != 1 + drafts))
    if mismatch.size:
        i = mismatch[0]
        fail(f"decode request {batch.req_ids[i]!r} schedules {batch.num_scheduled[i]} tokens,"
             f" expected 1 + {drafts[i]} draft tokens")


def _validate_blocks(batch: ScheduledBatch, config: RunnerConfig, num_kv_blocks, fail) -> None:
    tables = batch.block_tables
    if tables.ndim != 2 or tables.shape[0] != batch.num_reqs:
        fail(f"block_tables must be [num_reqs={batch.num_reqs}, max_blocks], got shape {tables.shape}")
    if tables.shape[1] > config.max_blocks_per_req:
        fail(f"block_tables has {tables.shape[1]} columns, more than max_blocks_per_req={config.max_blocks_per_req}")
    if batch.num_reqs == 0:
        return
    needed = -(-(batch.num_computed + batch.num_scheduled) // config.block_size)
    if needed.max() > tables.shape[1]:
        i = np.flatnonzero(needed > tables.shape[1])[0]
        fail(f"request {batch.req_ids[i]!r} needs {needed[i]} KV blocks for position"
             f" {batch.num_computed[i] + batch.num_scheduled[i] - 1}, its block table holds {tables.shape[1]}")
    upper = num_kv_blocks if num_kv_blocks is not None else np.iinfo(np.int64).max
    if tables.size and (tables.min() < 0 or tables.max() >= upper):  # only then: are the bad ids used?
        used = np.arange(tables.shape[1])[None, :] < needed[:, None]
        bad = np.argwhere(used & ((tables < 0) | (tables >= upper)))
        if bad.size:
            i, j = bad[0]
            fail(f"request {batch.req_ids[i]!r} uses block id {tables[i, j]} (table column {j}),"
                 f" outside [0, {upper})")
