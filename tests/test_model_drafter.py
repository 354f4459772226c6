"""The replicated drafter: its rows, and speculative decoding end to end in one process.

A draft that is an exact copy of the target must have every proposal accepted (so rows,
positions and KV reuse are right); any draft must leave greedy outputs unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_fsm import dp
from runner_fsm.replica.components import ForwardStep
from runner_fsm.errors import BatchError
from runner_fsm.model import draft_rows
from runner_fsm.replica.spec import tokens_per_request

from test_model_support import (
    BLOCK_SIZE, NUM_BLOCKS, TargetDriver, batch, block_table, make_model_dirs, open_drafter, open_target,
    prompt, runner_config,
)

K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_model_dirs(tmp_path_factory.mktemp("models"))


class SpecLoop:
    """A tiny scheduler: target verify step, then the draft's prefill and K-1 decodes."""

    def __init__(self, target, drafter, prompts, *, k: int, tables=None):
        self.target, self.drafter, self.k = target, drafter, k
        self.seqs = [list(p) for p in prompts]
        self.tables = tables or [block_table(i) for i in range(len(prompts))]
        self.proposals: dict[str, list[int]] = {}
        self.appended: list[list[int]] = []  # per step, tokens appended per request
        self.step_id = 0

    def _batch(self):
        ids = [f"r{i}" for i in range(len(self.seqs))]
        if self.step_id == 0:
            return batch(ids, [len(s) for s in self.seqs], [True] * len(ids), [0] * len(ids),
                         [t for s in self.seqs for t in s], self.tables)
        drafts = [self.proposals.get(rid, []) for rid in ids] if self.k else [[] for _ in ids]
        tokens = [t for s, d in zip(self.seqs, drafts) for t in [s[-1], *d]]
        return batch(ids, [1 + len(d) for d in drafts], [False] * len(ids), [len(s) - 1 for s in self.seqs],
                     tokens, self.tables, num_draft_tokens=[len(d) for d in drafts])

    def step(self):
        b = self._batch()
        result = self.target.run(b, self.target.agree_alone(b, self.step_id))
        sampled = tokens_per_request(result.tokens, b)
        for i, rid in enumerate(b.req_ids):
            self.seqs[i].extend(sampled[rid])
        self.appended.append([len(sampled[rid]) for rid in b.req_ids])
        if self.k:
            self._draft(b, sampled)
        self.step_id += 1

    def _draft(self, b, sampled):
        rows = self.drafter.prefill_rows(b, sampled)
        agreed = dp.agree([dp.LocalDispatch(self.step_id, dp.DRAFT_PREFILL, 0, rows, 0, 0, b.num_reqs)])
        self.drafter.prefill(b, sampled, ForwardStep(self.step_id, rows, agreed, rows))
        agreed = dp.agree([dp.LocalDispatch(self.step_id, dp.DRAFT_DECODE, 0, b.num_reqs, 0, 0, b.num_reqs)])
        for _ in range(self.k - 1):
            self.drafter.decode(ForwardStep(self.step_id, b.num_reqs, agreed, b.num_reqs))
        self.proposals = self.drafter.proposals()
        assert all(len(p) == self.k for p in self.proposals.values())


PROMPTS = [prompt(9, 21), prompt(5, 22), prompt(14, 23)]


def _greedy(target_dir, length: int):
    """Plain greedy decoding (no drafts) until every sequence has `length` new tokens."""
    loop = SpecLoop(TargetDriver(open_target(target_dir), runner_config()), None, PROMPTS, k=0)
    while min(len(s) - len(p) for s, p in zip(loop.seqs, PROMPTS)) < length:
        loop.step()
    return [s[len(p):len(p) + length] for s, p in zip(loop.seqs, PROMPTS)]


def _speculate(target_dir, draft_dir, steps: int, **kw):
    loop = SpecLoop(TargetDriver(open_target(target_dir), runner_config(num_speculative_tokens=K)),
                    open_drafter(draft_dir), PROMPTS, k=K, **kw)
    for _ in range(steps):
        loop.step()
    return loop


def test_a_copy_of_the_target_has_every_proposal_accepted(dirs):
    target_dir, _ = dirs
    loop = _speculate(target_dir, target_dir, steps=5)
    assert loop.appended[0] == [1, 1, 1]
    assert all(counts == [K + 1] * 3 for counts in loop.appended[1:]), loop.appended
    new = 1 + 4 * (K + 1)
    assert [s[len(p):] for s, p in zip(loop.seqs, PROMPTS)] == _greedy(target_dir, new)


def test_a_different_draft_leaves_greedy_outputs_unchanged(dirs):
    target_dir, draft_dir = dirs
    loop = _speculate(target_dir, draft_dir, steps=6)
    new = min(len(s) - len(p) for s, p in zip(loop.seqs, PROMPTS))
    assert new >= 6
    assert [s[len(p):len(p) + new] for s, p in zip(loop.seqs, PROMPTS)] == _greedy(target_dir, new)


def test_drafts_without_lookahead_blocks_still_verify(dirs, monkeypatch):
    """Tables exactly as long as the target needs: the last drafts have no block to write."""
    target_dir, _ = dirs
    decode_slots = []

    def recording(*args, **kw):
        rows = real_decode_rows(*args, **kw)
        decode_slots.extend(rows.slots.tolist())
        return rows

    real_decode_rows = draft_rows.decode_rows
    monkeypatch.setattr(draft_rows, "decode_rows", recording)
    lengths = [len(p) + 1 + 2 * (K + 1) + 1 for p in PROMPTS]  # what two full verify steps need
    width = -(-max(lengths) // BLOCK_SIZE)
    tables = [block_table(i)[: -(-n // BLOCK_SIZE)] for i, n in enumerate(lengths)]
    tables = [t + [-1] * (width - len(t)) for t in tables]  # -1: no block
    loop = _speculate(target_dir, target_dir, steps=3, tables=tables)
    assert -1 in decode_slots  # some proposals ran past the blocks
    new = min(len(s) - len(p) for s, p in zip(loop.seqs, PROMPTS))
    assert [s[len(p):len(p) + new] for s, p in zip(loop.seqs, PROMPTS)] == _greedy(target_dir, new)


def test_idle_replica_drafts_a_dummy_that_writes_nothing(dirs):
    _, draft_dir = dirs
    drafter = open_drafter(draft_dir)
    before = drafter.cache.k[:, :-1].clone()
    # The peer replica drafts 5 rows; this one agreed 0 and runs one dummy row.
    agreed = dp.agree([dp.LocalDispatch(0, dp.DRAFT_PREFILL, 0, 0, 0, 0, 0),
                       dp.LocalDispatch(0, dp.DRAFT_PREFILL, 0, 5, 0, 0, 2)])
    drafter.prefill(None, None, ForwardStep(0, 1, agreed, 0, is_dummy=True))
    drafter.decode(ForwardStep(0, 1, agreed, 0, is_dummy=True))
    assert drafter.proposals() == {}
    assert torch.equal(drafter.cache.k[:, :-1], before)


def test_draft_rows_of_a_prefill_and_a_verified_decode():
    # r0: prefill chunk [11 12 13] at 0..2, kept 50.  r1: decode at 7 with drafts [21 22],
    # scheduled [20 21 22]; verification kept [21, 60] (draft 21 accepted, 22 replaced).
    b = batch(["r0", "r1"], [3, 3], [True, False], [0, 7], [11, 12, 13, 20, 21, 22],
              [[4, 5, 6], [3, 8, 9]], num_draft_tokens=[0, 2])
    sampled = {"r0": [50], "r1": [21, 60]}
    assert draft_rows.prefill_row_count(b, sampled) == 7
    rows = draft_rows.prefill_rows(b, sampled, block_size=4, num_blocks=10)
    assert rows.input_ids.tolist() == [11, 12, 13, 50, 20, 21, 60]
    assert rows.positions.tolist() == [0, 1, 2, 3, 7, 8, 9]
    assert rows.query_start_loc.tolist() == [0, 4, 7] and rows.seq_lens.tolist() == [4, 10]
    assert rows.slots.tolist() == [16, 17, 18, 19, 35, 36, 37]  # r1: block 8 holds 4..7, block 9 8..11
    assert rows.last_rows.tolist() == [3, 6]
    # Block 9 is not a block of a 9-block cache: position 8 on has nowhere to go.
    short = draft_rows.prefill_rows(b, sampled, block_size=4, num_blocks=9)
    assert short.slots.tolist()[4:] == [35, -1, -1] and short.seq_lens.tolist() == [4, 8]
    with pytest.raises(BatchError, match="request 'r1' has no sampled token"):
        draft_rows.prefill_rows(b, {"r0": [1]}, block_size=4, num_blocks=10)


def test_draft_rows_are_replica_layout_values():
    dummy = draft_rows.dummy_rows(3)
    assert dummy.num_rows == 3 and (dummy.slots == -1).all() and dummy.query_start_loc.tolist() == [0, 3]
    rows = draft_rows.decode_rows(np.array([5, 6]), np.array([3, 8]), np.array([[1, 2], [3, 4]]),
                                  block_size=4, num_blocks=NUM_BLOCKS)
    assert rows.positions.tolist() == [3, 8] and rows.slots.tolist() == [7, -1]  # position 8: no 3rd block
    assert rows.seq_lens.tolist() == [4, 8]
