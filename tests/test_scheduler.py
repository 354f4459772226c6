"""The embedded scheduler against a simulated paged model.

The simulated model keeps one paged KV cache for the replica, `num_kv_blocks x block_size`
slots, and reaches it only through the batch's block tables: each scheduled row writes its
token into the slot of its position (`block_tables[i][p // bs] * bs + p % bs`) and predicts
f(the tokens read back from the slots of positions 0..p). So it reads exactly what a real
paged model would, stale entries included: a scheduler that mis-tracks num_computed, drafts
or blocks (two requests sharing a block, a block handed out while still in use) produces
outputs that differ from plain greedy generation.
"""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm.batch import validate_batch
from runner_fsm.config import RunnerConfig
from runner_fsm.engine.requests import Request, assign, synthetic_requests
from runner_fsm.engine.scheduler import Scheduler, SchedulerConfig, max_positions
from runner_fsm.replica.spec import tokens_per_request

VOCAB = 50


def next_token(prefix) -> int:
    return zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes()) % VOCAB


def greedy(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class SimulatedModel:
    def __init__(self, cfg: SchedulerConfig, draft_quality: float, seed: int = 0):
        self.kv = np.full(cfg.num_kv_blocks * cfg.block_size, -1, dtype=np.int64)  # token per slot
        self.block_size = cfg.block_size
        self.k, self.quality = cfg.num_speculative_tokens, draft_quality
        self.rng = np.random.default_rng(seed)

    def _slot(self, table, pos: int) -> int:
        block = int(table[pos // self.block_size])
        assert block >= 0, f"position {pos} falls on a padding column of the block table"
        return block * self.block_size + pos % self.block_size

    def _read(self, table, length: int) -> list[int]:
        return [int(self.kv[self._slot(table, p)]) for p in range(length)]

    def step(self, batch):
        rows, start = [], 0
        for i, rid in enumerate(batch.req_ids):
            table = batch.block_tables[i]
            for j in range(int(batch.num_scheduled[i])):
                pos = int(batch.num_computed[i]) + j
                self.kv[self._slot(table, pos)] = int(batch.token_ids[start + j])
                rows.append(next_token(self._read(table, pos + 1)))
            start += int(batch.num_scheduled[i])
        sampled = tokens_per_request(np.array(rows), batch)
        drafts = {}
        for i, rid in enumerate(batch.req_ids):
            k = 0 if batch.num_draft_tokens is None else int(batch.num_draft_tokens[i])
            valid = len(sampled[rid]) if k else int(batch.num_scheduled[i])  # rows now in the cache
            ctx = self._read(batch.block_tables[i], int(batch.num_computed[i]) + valid) + [sampled[rid][-1]]
            proposal = []
            for _ in range(self.k):  # a perfect drafter, made wrong with probability 1 - quality
                tok = next_token(ctx) if self.rng.random() < self.quality else int(self.rng.integers(VOCAB))
                proposal.append(tok)
                ctx = ctx + [tok]
            drafts[rid] = proposal
        return sampled, drafts


def run(requests, cfg: SchedulerConfig, draft_quality=1.0, max_steps=2000):
    sched = Scheduler(requests, cfg)
    model = SimulatedModel(cfg, draft_quality)
    by_id = {r.req_id: r for r in requests}
    runner_cfg = RunnerConfig(max_num_tokens=cfg.token_budget, max_num_reqs=cfg.max_num_reqs,
                              block_size=cfg.block_size, max_blocks_per_req=cfg.max_blocks_per_req,
                              num_speculative_tokens=cfg.num_speculative_tokens)
    for step in range(max_steps):
        if sched.num_unfinished == 0:
            return sched, step
        batch = sched.schedule(step)
        if batch is None:
            continue
        validate_batch(batch, runner_cfg, num_kv_blocks=cfg.num_kv_blocks)
        for i, rid in enumerate(batch.req_ids):  # admission's bound on a request's KV holds
            req = by_id[rid]
            peak = max_positions(len(req.prompt), req.max_new_tokens, cfg.num_speculative_tokens)
            assert int((batch.block_tables[i] >= 0).sum()) <= -(-peak // cfg.block_size), (step, rid)
        sampled, drafts = model.step(batch)
        sched.update(sampled, drafts if cfg.num_speculative_tokens else {})
    raise AssertionError("scheduler did not finish")


def expected(requests):
    return {r.req_id: greedy(r.prompt, r.max_new_tokens) for r in requests}


REQS = synthetic_requests(12, vocab_size=VOCAB, seed=3, max_prompt=40, max_new_tokens=9, arrival_every=2)


def test_plain_continuous_batching_matches_greedy():
    sched, _ = run(REQS, SchedulerConfig(token_budget=64))
    assert sched.results() == expected(REQS)
    assert sched.allocator.num_free == sched.allocator.num_blocks  # every block freed


def test_chunked_prefill_under_small_budget():
    sched, steps = run(REQS, SchedulerConfig(token_budget=7, block_size=4, max_blocks_per_req=16))
    assert sched.results() == expected(REQS)


def test_preemption_under_block_pressure_keeps_outputs():
    sched, _ = run(REQS, SchedulerConfig(token_budget=64, num_kv_blocks=14, block_size=4, max_blocks_per_req=14))
    assert sched.num_preemptions > 0
    assert sched.results() == expected(REQS)


@pytest.mark.parametrize("quality", [1.0, 0.5, 0.0])
def test_speculative_decoding_never_changes_outputs(quality):
    cfg = SchedulerConfig(token_budget=64, num_speculative_tokens=3)
    sched, steps = run(REQS, cfg, draft_quality=quality)
    assert sched.results() == expected(REQS)


def test_accepted_drafts_save_steps():
    steps = run(REQS, SchedulerConfig(token_budget=64, num_speculative_tokens=3), draft_quality=1.0)[1]
    plain_steps = run(REQS, SchedulerConfig(token_budget=64))[1]
    assert steps < plain_steps


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(8, 40), st.integers(0, 3), st.integers(0, 10_000))
def test_any_budget_blocks_and_k_match_greedy(budget, blocks, k, seed):
    reqs = synthetic_requests(5, vocab_size=VOCAB, seed=seed, max_prompt=20, max_new_tokens=5, arrival_every=1)
    cfg = SchedulerConfig(token_budget=budget, num_kv_blocks=blocks, block_size=4,
                          max_blocks_per_req=8, num_speculative_tokens=k)
    sched, _ = run(reqs, cfg, draft_quality=0.6)
    assert sched.results() == expected(reqs)


def test_assign_round_robin_and_pinned():
    reqs = [Request("a", (1,), 1), Request("b", (1,), 1, replica=0), Request("c", (1,), 1), Request("d", (1,), 1)]
    assert [[r.req_id for r in rs] for rs in assign(reqs, 2)] == [["a", "b", "d"], ["c"]]
    with pytest.raises(Exception, match="pinned to replica 3"):
        assign([Request("x", (1,), 1, replica=3)], 2)


def test_request_too_long_for_block_table_is_refused():
    with pytest.raises(Exception, match="more than a block table holds"):
        Scheduler([Request("x", tuple(range(60)), 10)], SchedulerConfig(block_size=4, max_blocks_per_req=8))
