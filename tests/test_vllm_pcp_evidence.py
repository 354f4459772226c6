"""The PCP evidence of vLLM MRV2's PCP manager (`runners/pcp/evidence.py`), over a fake manager: what it
logs is judged by replay's own rules (`rules.checks`), and each injected PCP fault leaves
evidence those rules reject. No vLLM needed (the end-to-end runs are in test_vllm_pcp_dp.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runner_fsm.rules.checks import (BufferTracker, dispatch_inputs, dispatch_problem, recomputed_dispatch_count,
                                     stale_inputs)
from runner_fsm.rules.context_rule import context_evidence_missing, context_problem
from runner_fsm.integrations.vllm.runners.pcp_evidence import PAD_SLOT_ID, PCPEvidence, layout_digest
from runner_fsm.pcp.plan import num_tokens_for_dispatch

PCP = 2


def mrv2_dispatch_count(scheduled, prefilling, pcp: int) -> int:
    """MRV2's rule for the PCP-local dispatch count, written out per request here as the
    reference the code under test is held to (vLLM's `PCPManager._iter_rank_chunks` without
    DCP): a prefill of L tokens is cut into 2P chunks of ceil(L / 2P) tokens (the last ones
    short or empty) and rank r takes chunks r and 2P-1-r; a decode row goes whole to one rank,
    the k-th decode of the batch (rows with no tokens skipped) to rank k mod P. The count is the
    widest rank."""
    load, decodes = [0] * pcp, 0
    for length, is_prefill in zip(scheduled, prefilling):
        if length == 0:
            continue
        if is_prefill:
            size = -(-length // (2 * pcp))
            for rank in range(pcp):
                for chunk in (rank, 2 * pcp - 1 - rank):
                    load[rank] += max(0, min(size, length - chunk * size))
        else:
            load[decodes % pcp] += length
            decodes += 1
    return max(load)


@dataclasses.dataclass
class Batch:  # the fields of vLLM's InputBatch the evidence reads
    num_tokens: int
    num_tokens_after_padding: int
    num_reqs_after_padding: int
    num_scheduled_tokens: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    is_padding: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


class FakeManagerBase:
    """The PCP manager's persistent buffers and the methods the evidence wraps, written the way
    vLLM writes them (torch ops, so their write counters move)."""

    pcp_world_size, shard_decode_requests = PCP, True

    def __init__(self):
        self.input_buffers = SimpleNamespace(input_ids=torch.zeros(64, dtype=torch.int32),
                                             positions=torch.zeros(64, dtype=torch.int64),
                                             is_padding=torch.zeros(64, dtype=torch.bool),
                                             query_start_loc=torch.zeros(9, dtype=torch.int32),
                                             seq_lens=torch.zeros(8, dtype=torch.int32))
        self._gathered_kv_slot_mappings = torch.zeros(1, 128, dtype=torch.int64)
        self._hidden_restore_idx = None

    def get_num_tokens_for_dispatch(self, num_scheduled, is_prefilling):
        return mrv2_dispatch_count(num_scheduled, is_prefilling, PCP)

    def _stage(self, batch):
        b, n, r = self.input_buffers, batch.num_tokens_after_padding, batch.num_reqs_after_padding
        return dataclasses.replace(batch, input_ids=b.input_ids[:n].copy_(batch.input_ids),
                                   positions=b.positions[:n].copy_(batch.positions),
                                   is_padding=b.is_padding[:n].copy_(batch.is_padding),
                                   query_start_loc=b.query_start_loc[:r + 1].copy_(batch.query_start_loc),
                                   seq_lens=b.seq_lens[:r].copy_(batch.seq_lens))

    def get_dummy_slot_mappings(self, num_tokens):
        self._gathered_kv_slot_mappings.fill_(PAD_SLOT_ID)
        return self._gathered_kv_slot_mappings[:, :num_tokens * PCP]

    # what partition_batch + prepare_attn do for a real batch (this rank's rows)
    def real(self, tokens: list[int], step: int) -> tuple[Batch, torch.Tensor]:
        b, n = self.input_buffers, len(tokens)
        b.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.int32))
        b.positions[:n].copy_(torch.arange(n) + step)
        b.query_start_loc[:2].copy_(torch.tensor([0, n], dtype=torch.int32))
        b.seq_lens[:1].copy_(torch.tensor([n + step], dtype=torch.int32))
        self._hidden_restore_idx = torch.arange(n * PCP, dtype=torch.int64)
        slots = self._gathered_kv_slot_mappings[:, :n * PCP]
        torch.add(torch.arange(n * PCP, dtype=torch.int64).unsqueeze(0), 16 * step, out=slots)
        batch = Batch(n, n, 1, np.array([n], dtype=np.int32), b.input_ids[:n], b.positions[:n],
                      b.is_padding[:n], b.query_start_loc[:2], b.seq_lens[:1])
        return batch, slots


def dummy_batch(n: int = 2) -> Batch:
    return Batch(n, n, 1, np.array([n], dtype=np.int32), torch.zeros(n, dtype=torch.int32),
                 torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool),
                 torch.tensor([0, n], dtype=torch.int32), torch.ones(1, dtype=torch.int32))


class FakeManager(FakeManagerBase):
    """vLLM 0.32's manager."""

    def prepare_inputs_to_capture(self, batch):
        return self._stage(batch)


class FakeManager033(FakeManagerBase):
    """vLLM 0.33's manager: the capture preparation renamed `prepare_inputs_for_capture_or_profile`,
    and the staged padding mask expanded to the PCP-gathered rows an MoE routes (`moe_is_padding`,
    into `_moe_is_padding`), which a real batch writes too (pcp_manager.py:92-96, 630-635 and
    735-763 in vLLM 0.33.0)."""

    def __init__(self):
        super().__init__()
        self._moe_is_padding = torch.ones(64 * PCP, dtype=torch.bool)

    def prepare_inputs_for_capture_or_profile(self, batch):
        staged = self._stage(batch)
        return dataclasses.replace(staged, is_padding=self.moe_is_padding(staged.is_padding))

    def moe_is_padding(self, is_padding):
        out = self._moe_is_padding[: PCP * is_padding.shape[0]]
        out.view(PCP, -1).copy_(is_padding)
        return out

    def real(self, tokens, step):
        batch, slots = super().real(tokens, step)
        n = len(tokens)  # every rank's n rows real: none padding (a real batch's gathered mask)
        self._moe_is_padding[: PCP * n].fill_(False)
        return batch, slots


class Run:
    """One replica rank through steps, as the MRV2 runner calls its PCP manager."""

    def __init__(self, fault: str | None = None, at_step: int = -1, manager_cls=FakeManager):
        self.step = 0
        self.manager = manager_cls()
        self.staged: list = []  # each dummy's staged batch, and its padding mask then
        self.evidence = PCPEvidence(self.manager, lambda: self.step, lambda kind: kind == fault and self.step == at_step)
        self.tracker = BufferTracker()
        self.records: list[tuple[str, int, dict]] = []

    def real_step(self, tokens):
        self.evidence.agreement_extra(self.step)  # no stale dispatch inputs left over
        count = self.manager.get_num_tokens_for_dispatch(np.array([len(tokens) * PCP]), np.array([True]))
        extra = self.evidence.agreement_extra(self.step)
        batch, slots = self.manager.real(tokens, self.step)
        self.evidence.real_prepared(batch, slots)
        self._forward(dummy=False)
        self.step += 1
        return count, extra

    def dummy_step(self, n: int = 2):
        stage = getattr(self.manager, "prepare_inputs_to_capture", None) or \
            self.manager.prepare_inputs_for_capture_or_profile
        batch = stage(dummy_batch(n))
        self.staged.append((batch, batch.is_padding.tolist()))  # the mask as the forward reads it
        slots = self.manager.get_dummy_slot_mappings(batch.num_tokens)
        self.evidence.dummy_prepared(batch, slots)
        self._forward(dummy=True)
        self.step += 1

    def _forward(self, *, dummy: bool):
        fingerprints, ids = self.evidence.forward_evidence()
        self.tracker.new_step()
        assert self.tracker.buffers({"reason": "dummy" if dummy else "real", "buffers": fingerprints}, self.step) == []
        problems = self.tracker.eager_forward(self.step)
        assert context_evidence_missing(ids["batch"], ids["ctx"]) is None
        ctx_problem = context_problem(self.step, ids["batch"], ids["ctx"])
        self.records.append((self.step, problems, ctx_problem))


def findings(run: Run) -> dict[int, tuple]:
    return {step: (problems, ctx) for step, problems, ctx in run.records if problems or ctx}


def test_sound_steps_leave_sound_evidence():
    run = Run()
    run.real_step([5, 6, 7])
    run.real_step([8])
    run.dummy_step()
    run.dummy_step()
    run.real_step([9, 10])
    assert findings(run) == {}


def _two_real_then_two_dummies(run: "Run") -> "Run":
    run.real_step([5, 6, 7])
    run.real_step([8])
    run.dummy_step()
    run.dummy_step()
    return run


def test_stale_pcp_context_is_a_stale_context_at_its_step():
    run = _two_real_then_two_dummies(Run("stale-pcp-context", at_step=2))
    found = findings(run)
    assert list(found) == [2]
    problems, ctx = found[2]
    assert ctx.startswith("the dummy forward of step 2 (2 rows) used a real batch's PCP context built at step 1")
    # the slot mappings were not written for the dummy either
    assert problems and "pcp.slot_mapping" in problems[0]


def test_skip_buffer_refresh_is_stale_inputs_at_its_step():
    run = _two_real_then_two_dummies(Run("skip-buffer-refresh", at_step=3))
    found = findings(run)
    assert list(found) == [3]
    problems, ctx = found[3]
    assert ctx is None
    assert "were not refreshed this step" in problems[0]
    for name in ("pcp.input_ids", "pcp.positions", "pcp.query_start_loc", "pcp.seq_lens"):
        assert name in problems[0]
    assert "pcp.slot_mapping" not in problems[0]


def test_vllm_033s_capture_preparation_is_wrapped_under_its_name():
    """0.33 renamed the manager's staging and expands its mask: the evidence follows it. Failed on
    a16b93e (the evidence wrapped `prepare_inputs_to_capture` only, which 0.33's manager lacks)."""
    run = _two_real_then_two_dummies(Run(manager_cls=FakeManager033))
    assert findings(run) == {}
    staged, mask = run.staged[-1]  # the dummy's mask, expanded to PCP x 2 rows, all padding
    assert staged.is_padding.data_ptr() == run.manager._moe_is_padding.data_ptr()
    assert mask == [True] * (PCP * 2)
    assert run.evidence._capture_name == "prepare_inputs_for_capture_or_profile"


def test_skip_buffer_refresh_on_033_reads_the_expanded_mask_the_real_batch_left():
    """Mutation seen to fail it: `_stale_padding` returning the manager's own `is_padding` (0.32's
    stale view), which is not the mask 0.33's MoE reads."""
    run = _two_real_then_two_dummies(Run("skip-buffer-refresh", at_step=2, manager_cls=FakeManager033))
    found = findings(run)
    assert list(found) == [2]
    assert "were not refreshed this step" in found[2][0][0]
    stale, mask = run.staged[0]  # not refreshed: the real batches' "no padding", PCP x 2 rows
    assert stale.is_padding.data_ptr() == run.manager._moe_is_padding.data_ptr() and mask == [False] * (PCP * 2)
    assert run.staged[1][1] == [True] * (PCP * 2)  # step 3's dummy, refreshed


def test_manager_names_follow_the_release():
    """Failed on a16b93e: one list of names, 0.32's, for every release."""
    from runner_fsm.integrations.vllm.runners.pcp_evidence import manager_names

    assert "prepare_inputs_to_capture" in manager_names("0.32.0")
    assert "prepare_inputs_for_capture_or_profile" not in manager_names("0.32.0")
    new = manager_names("0.33.0")
    assert {"prepare_inputs_for_capture_or_profile", "moe_is_padding", "_moe_is_padding"} <= set(new)
    assert "prepare_inputs_to_capture" not in new


def test_wrong_dispatch_count_is_a_dispatch_mismatch():
    run = Run("wrong-dispatch-count", at_step=1)
    count0, extra0 = run.real_step([5, 6, 7, 8])  # an 8-token prefill: 4 per rank
    count1, extra1 = run.real_step([9, 10, 11, 12])
    assert count0 == 4 and count1 == 8
    assert dispatch_problem(extra0["inputs"], count0) is None
    problem = dispatch_problem(extra1["inputs"], count1)
    assert problem is not None and "dispatches 4 tokens per PCP rank" in problem


def test_dispatch_evidence_missing_is_not_a_count():
    run = Run()
    assert run.evidence.agreement_extra(0) == {}  # no count taken in this step: nothing to log


@pytest.mark.parametrize("scheduled,prefilling", [
    ([1, 1, 1], [False, False, False]),  # sharded decodes: 2 on rank 0, 1 on rank 1
    ([1, 1, 9, 1], [False, False, True, False]),
    ([17, 1], [True, False]),
    ([3, 0, 2, 5], [False, False, False, True]),  # a zero-token row takes no decode turn
])
def test_per_decode_inputs_recompute_mrv2s_count(scheduled, prefilling):
    """What replay recomputes from the logged inputs is MRV2's count, by the rule written out
    above. Mutation seen to fail this: `_dispatch_count` (rules/checks.py) summing the `decodes`
    into one replicated row (`decodes = (decode,)`)."""
    inputs = dispatch_inputs(scheduled, prefilling, PCP, "mrv2", per_decode=True)
    assert recomputed_dispatch_count(inputs) == mrv2_dispatch_count(scheduled, prefilling, PCP)
    # a global count is caught even where it equals the decode tokens' sum (the shortcut
    # replay takes for replicated decodes must not apply to sharded ones)
    if not any(prefilling):
        assert dispatch_problem(inputs, sum(scheduled)) is not None


def test_layout_digest_covers_each_array():
    base = layout_digest(np.arange(4), np.arange(8), np.array([4]))
    assert base != layout_digest(np.arange(4), np.arange(8) + 1, np.array([4]))
    assert base != layout_digest(None, np.arange(8), np.array([4]))
    assert base != layout_digest(np.arange(4), np.arange(8), np.array([3]))


def test_stale_inputs_rule_is_the_shared_one():
    # the evidence is judged by `stale_inputs` itself: a buffer written leaves its counter moved
    now = {"pcp.seq_lens": (1, [1], 3, 7)}
    assert stale_inputs(now, {"pcp.seq_lens": (1, [1], 3, 7)}, None) is not None
    assert stale_inputs(now, {"pcp.seq_lens": (1, [1], 2, 7)}, None) is None


@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_recomputed_count_is_mrv2s_rule_on_random_batches(pcp):
    """The count replay recomputes from a batch's logged inputs, and the planner's, against the
    rule written out in this file, on random mixes of decodes, verify rows, prefills and empty
    rows. Mutation seen to fail this: `num_tokens_for_dispatch` (pcp/plan.py) replicating MRV2's
    decodes on every rank."""
    rng = np.random.default_rng(pcp)
    for _ in range(400):
        n = int(rng.integers(1, 12))
        prefilling = (rng.random(n) < 0.4).tolist()
        scheduled = [int(rng.integers(1, 60)) if p else int(rng.choice([0, 1, 1, 1, 3])) for p in prefilling]
        expected = mrv2_dispatch_count(scheduled, prefilling, pcp)
        inputs = dispatch_inputs(scheduled, prefilling, pcp, "mrv2", per_decode=True)
        assert recomputed_dispatch_count(inputs) == expected, (scheduled, prefilling)
        assert num_tokens_for_dispatch(scheduled, prefilling, pcp, chunking="mrv2") == expected, (scheduled, prefilling)
