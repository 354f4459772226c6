"""MRV2's drafter gate (`MRV2Runner.install_draft_gate`) over a stand-in speculator: the steps it
logs are the steps vLLM asked for. vLLM 0.33 calls `propose(..., num_speculative_tokens=0)` when
every replica agreed to skip drafts (vllm/v1/worker/gpu/model_runner.py:2118-2134 and 2320 in
0.33.0); that pass runs (its propose writes the draft model's KV cache without sampling) and is
logged as 0 draft steps, not K. Failed before: `kwargs.get(...) or K` logged K for vLLM's 0, and
the gate's 0 for it then skipped vLLM's own call."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner

K = 3


class Speculator:
    num_speculative_steps = K

    def __init__(self):
        self.calls: list[dict] = []

    def propose(self, input_batch, **kwargs):
        self.calls.append(kwargs)
        return torch.full((2, K), 7)


def _runner(gate_says=None):
    spec = Speculator()
    runner = SimpleNamespace(speculator=spec, req_states=SimpleNamespace(draft_tokens=torch.arange(4 * K).view(4, K)))
    adapter = MRV2Runner(runner)
    asked: list[tuple[bool, int]] = []

    def gate(dummy: bool, steps: int) -> int:
        asked.append((dummy, steps))
        return steps if gate_says is None else gate_says
    assert adapter.install_draft_gate(gate) is None
    return spec, asked


def test_vllms_own_zero_is_logged_as_zero_and_still_runs():
    spec, asked = _runner()
    batch = SimpleNamespace(idx_mapping=torch.tensor([0, 1]))
    spec.propose(batch, num_speculative_tokens=0)
    spec.propose(batch, dummy_run=True, num_speculative_tokens=0)
    spec.propose(batch)  # no count given: the speculator's K
    spec.propose(batch, num_speculative_tokens=2)
    assert asked == [(False, 0), (True, 0), (False, K), (False, 2)]
    assert [call.get("num_speculative_tokens") for call in spec.calls] == [0, 0, None, 2]


def test_the_gates_zero_skips_a_pass_vllm_asked_for():
    spec, asked = _runner(gate_says=0)
    batch = SimpleNamespace(idx_mapping=torch.tensor([1, 2]))
    kept = spec.propose(batch, num_speculative_tokens=K)  # busy: the requests' previous drafts
    assert kept.tolist() == [[3, 4, 5], [6, 7, 8]]
    assert spec.propose(batch, dummy_run=True) is None  # idle: nothing
    spec.propose(batch, num_speculative_tokens=0)  # vLLM's own 0 is not the gate's to skip
    assert asked == [(False, K), (True, K), (False, 0)]
    assert [call.get("num_speculative_tokens") for call in spec.calls] == [0]
