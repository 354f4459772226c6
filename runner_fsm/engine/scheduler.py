"""Continuous batching for one replica: token budget, chunked prefill, paged KV, preemption.

Every PCP rank of a replica runs the same scheduler on the same inputs (its requests and
the sampled tokens, which restore makes identical on the PCP ranks), so they schedule the
same batches without a broadcast.

A request's known tokens are its prompt then its outputs; `num_computed` of them are in the
KV cache. More than one token left to compute makes it a prefill (a prompt chunk, or a
recompute after preemption), exactly one a decode, which carries the drafts to verify.
"""

from __future__ import annotations

import dataclasses

from runner_fsm.batch import ScheduledBatch
from runner_fsm.engine.kv_blocks import BlockAllocator
from runner_fsm.engine.requests import Request
from runner_fsm.errors import ConfigError, RunnerError


class RequestRefused(ConfigError):
    """A request that can never be served by this configuration, refused before any step."""


class SchedulerStalled(RunnerError):
    """Nothing can run and nothing will change: requests wait for blocks they can never get."""


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one replica's scheduler; identical on every rank."""

    num_kv_blocks: int = 256
    block_size: int = 16
    max_blocks_per_req: int = 64
    token_budget: int = 256  # global tokens per step
    max_num_reqs: int = 16
    num_speculative_tokens: int = 0
    max_model_len: int | None = None  # positions the model supports (None: no limit)


@dataclasses.dataclass
class _Live:
    req: Request
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.req.prompt)


@dataclasses.dataclass(frozen=True)
class _Slot:
    live: _Live
    num_scheduled: int
    drafts: tuple[int, ...]


class Scheduler:
    """Schedules one replica's requests step by step and applies each step's output."""

    def __init__(self, requests: list[Request], config: SchedulerConfig):
        self.config = config
        self.allocator = BlockAllocator(config.num_kv_blocks)
        for req in requests:
            refusal = admission_error(req, config)
            if refusal is not None:
                raise RequestRefused(refusal)
        self._future = sorted(requests, key=lambda r: r.arrival_step)
        self.waiting: list[_Live] = []
        self.running: list[_Live] = []
        self.finished: dict[str, list[int]] = {}
        self.num_preemptions = 0
        self._slots: list[_Slot] = []
        self._newly_finished: list[str] = []  # told to the replica with the next batch

    @property
    def num_unfinished(self) -> int:
        return len(self._future) + len(self.waiting) + len(self.running)

    def results(self) -> dict[str, list[int]]:
        return dict(self.finished)

    # -- scheduling -------------------------------------------------------------------

    def schedule(self, step: int) -> ScheduledBatch | None:
        """The batch of `step`, or None when nothing can run (then the replica idles)."""
        while self._future and self._future[0].arrival_step <= step:
            req = self._future.pop(0)
            self.waiting.append(_Live(req, list(req.prompt)))
        budget, slots = self.config.token_budget, []
        for live in list(self.running):
            if live not in self.running:  # preempted while making room for an earlier one
                continue
            slot = self._fit(live, budget, may_preempt=True)
            if slot is not None:
                slots.append(slot)
                budget -= slot.num_scheduled
        while self.waiting and budget > 0 and len(slots) < self.config.max_num_reqs:
            slot = self._fit(self.waiting[0], budget, may_preempt=False)
            if slot is None:
                break
            self.running.append(self.waiting.pop(0))
            slots.append(slot)
            budget -= slot.num_scheduled
        self._slots = slots
        if not slots and self.waiting and not self.running:
            # Every block is free yet the head of the queue does not fit: no step will ever
            # change that, and idling here would spin for ever.
            head = self.waiting[0]
            raise SchedulerStalled(
                f"step {step}: request {head.req.req_id!r} needs"
                f" {self._blocks_for(head)} KV blocks to run its next"
                f" {len(head.tokens) - head.num_computed} token(s), but only"
                f" {self.allocator.num_free} of {self.allocator.num_blocks} are free with nothing"
                f" running; {len(self.waiting)} request(s) wait for blocks they can never get")
        return self._batch(slots) if slots else None

    def _blocks_for(self, live: _Live) -> int:
        count = min(len(live.tokens) - live.num_computed, self.config.token_budget)
        reach = live.num_computed + count + self.config.num_speculative_tokens
        return -(-reach // self.config.block_size) - len(live.blocks)

    def _fit(self, live: _Live, budget: int, *, may_preempt: bool) -> _Slot | None:
        remaining = len(live.tokens) - live.num_computed
        drafts = tuple(live.drafts) if remaining == 1 else ()
        count = min(remaining + len(drafts), budget)
        if count < remaining + len(drafts):
            drafts = ()  # a decode that cannot carry its drafts runs without them
            count = min(remaining, budget)
        if count <= 0:
            return None
        # Lookahead for the draft: it writes up to K positions past the target's.
        reach = live.num_computed + count + self.config.num_speculative_tokens
        needed = -(-reach // self.config.block_size) - len(live.blocks)
        while needed > 0:
            fresh = self.allocator.allocate(needed)
            if fresh is not None:
                live.blocks.extend(fresh)
                break
            if not may_preempt:
                return None
            # Running requests are scheduled front to back, so only those behind `live`
            # are still unscheduled: the last one makes room; with none left, `live` yields.
            victim = self.running[-1]
            self._preempt(victim)
            if victim is live:
                return None
        return _Slot(live, count, drafts)

    def _preempt(self, victim: _Live) -> None:
        """Recompute preemption: free the blocks, recompute every known token later."""
        self.running.remove(victim)
        self.allocator.free(victim.blocks)
        victim.blocks, victim.num_computed, victim.drafts = [], 0, []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, victim)

    def _batch(self, slots: list[_Slot]) -> ScheduledBatch:
        width = max(len(s.live.blocks) for s in slots)
        token_ids, tables = [], []
        for s in slots:
            start = s.live.num_computed
            remaining = len(s.live.tokens) - start
            token_ids.extend(s.live.tokens[start:start + min(remaining, s.num_scheduled)])
            token_ids.extend(s.drafts)
            # -1 pads: a padding column must never name another request's block.
            tables.append(s.live.blocks + [-1] * (width - len(s.live.blocks)))
        drafting = self.config.num_speculative_tokens > 0
        return ScheduledBatch.build(
            [s.live.req.req_id for s in slots], [s.num_scheduled for s in slots],
            [len(s.live.tokens) - s.live.num_computed > 1 for s in slots],
            [s.live.num_computed for s in slots], token_ids, tables,
            num_draft_tokens=[len(s.drafts) for s in slots] if drafting else None,
            finished_req_ids=self._take_finished())

    def _take_finished(self) -> list[str]:
        done, self._newly_finished = self._newly_finished, []
        return done

    # -- applying a step's output -------------------------------------------------------

    def update(self, sampled: dict[str, list[int]], drafts: dict[str, list[int]]) -> None:
        """Apply the step's tokens (verified) and next drafts to the scheduled requests."""
        for slot in self._slots:
            live, rid = slot.live, slot.live.req.req_id
            remaining = len(live.tokens) - live.num_computed
            if len(slot.drafts) == 0 and slot.num_scheduled < remaining:
                live.num_computed += slot.num_scheduled  # a prompt chunk: its sample is discarded
                continue
            new = sampled[rid]
            # The last known token and every accepted draft are now in the cache.
            live.num_computed += remaining + (len(new) - 1 if slot.drafts else 0)
            live.tokens.extend(new)
            live.drafts = list(drafts.get(rid, []))
            if live.num_outputs >= live.req.max_new_tokens:
                self._finish(live)
        self._slots = []

    def _finish(self, live: _Live) -> None:
        self.running.remove(live)
        self.allocator.free(live.blocks)
        live.blocks = []
        self.finished[live.req.req_id] = live.tokens[len(live.req.prompt):][: live.req.max_new_tokens]
        self._newly_finished.append(live.req.req_id)


def max_positions(prompt_len: int, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """KV positions a request may occupy at its peak. Its last decode starts with
    prompt + max_new - 2 tokens computed and runs 1 + K rows (a verify row), and the draft
    writes K positions past those: prompt + max_new - 1 + 2K."""
    return prompt_len + max_new_tokens - 1 + 2 * num_speculative_tokens


def admission_error(req: Request, config: SchedulerConfig) -> str | None:
    """Why `req` can never run under `config` (None when it can): checked at submission,
    so a request that could only wait for ever is refused before any step runs."""
    need = max_positions(len(req.prompt), req.max_new_tokens, config.num_speculative_tokens)
    what = (f"request {req.req_id!r} ({len(req.prompt)} prompt + {req.max_new_tokens} new tokens"
            + (f", {config.num_speculative_tokens} draft tokens" if config.num_speculative_tokens else "")
            + f") needs up to {need} KV positions")
    if config.max_model_len is not None and len(req.prompt) + req.max_new_tokens > config.max_model_len:
        return (f"request {req.req_id!r} needs {len(req.prompt) + req.max_new_tokens} positions"
                f" ({len(req.prompt)} prompt + {req.max_new_tokens} new tokens), more than"
                f" max_model_len={config.max_model_len}")
    blocks = -(-need // config.block_size)
    if blocks > config.num_kv_blocks:
        return (f"{what}, {blocks} blocks of {config.block_size}, but the replica has only"
                f" {config.num_kv_blocks} KV blocks (--kv-blocks)")
    if blocks > config.max_blocks_per_req:
        return (f"{what}, {blocks} blocks of {config.block_size}, more than a block table holds"
                f" ({config.max_blocks_per_req} blocks)")
    return None
