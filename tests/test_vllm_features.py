"""vLLM's own features keep working through FSMWorker, because they are vLLM's.

Speculative decoding with a draft model (K=2): vLLM's drafter and rejection sampler run
unchanged, each step logs a `draft` transition and the journal holds vLLM's proposals.
Under KV pressure (vLLM preempts and recomputes), with prefix caching, logprobs and an
aborted request, the outputs equal vLLM's default worker's and the log replays sound.
"""

from __future__ import annotations

import pytest
from vllm_checks import assert_replays_sound, transitions

import vllm_harness as h
from runner_fsm.integrations.vllm.recording.journal import read_journal

pytestmark = pytest.mark.vllm


def test_draft_model_speculation(vllm_models, tmp_path):
    model = vllm_models["llama"]
    requests = h.mixed_workload(num=6, seed=4)
    spec = dict(draft_dir=model, k=2)  # the model drafts for itself: most drafts are accepted
    with h.open_llm(**h.llm_kwargs(model, worker=None, **spec)) as llm:
        reference, _ = h.generate(llm, requests)
    run_dir = tmp_path / "run"
    with h.open_llm(**h.llm_kwargs(model, run_dir=str(run_dir), **spec)) as llm:
        outputs, _ = h.generate(llm, requests)
    assert outputs == reference
    triggers = transitions(run_dir)
    assert triggers.count("draft") == triggers.count("prefill") + triggers.count("decode")
    journal = read_journal(str(run_dir))
    assert sum(e["spec"] for e in journal) > 0  # vLLM scheduled drafts for verification
    proposed = [e["drafts"] for e in journal if "drafts" in e]
    assert proposed and all(len(d) == 2 for step in proposed for d in step if d)
    assert_replays_sound(run_dir)


def _pressure_run(model: str, requests, **kwargs):
    """Shared-prefix requests with logprobs under too few KV blocks (9 of 32 tokens for ~14 blocks
    of work); one request aborted."""
    from vllm import SamplingParams

    with h.open_llm(**h.llm_kwargs(model, num_gpu_blocks=9, max_model_len=256, enable_prefix_caching=True, **kwargs)) as llm:
        engine = llm.llm_engine
        for req in requests:
            params = SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, ignore_eos=True, logprobs=2)
            engine.add_request(req.req_id, {"prompt_token_ids": list(req.prompt)}, params)
        seen, logprobs, step = {}, {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = list(out.outputs[0].token_ids)
                logprobs[out.request_id] = [sorted(lp) for lp in out.outputs[0].logprobs]
            step += 1
            if step == 6:
                engine.abort_request(["p5"])
    return seen, logprobs


def test_preemption_prefix_cache_logprobs_abort(vllm_models, tmp_path):
    model = vllm_models["mixtral"]
    shared = tuple(range(10, 80))  # two full 32-token blocks shared by every request
    requests = [h.Req(f"p{i}", shared + (100 + i, 200 + i), 40) for i in range(6)]
    reference = _pressure_run(model, requests, worker=None)
    run_dir = tmp_path / "run"
    outputs = _pressure_run(model, requests, run_dir=str(run_dir))
    assert outputs == reference  # tokens and top-2 logprob ids of every position
    assert 0 < len(outputs[0]["p5"]) < 40  # aborted mid-generation
    triggers = transitions(run_dir)
    assert "prefill" in triggers and "decode" in triggers
    journal = read_journal(str(run_dir))
    # A preempted request came back as a prefill: V1 schedules it as resumed, MRV2 as new again.
    assert sum(e["resumed"] for e in journal) + sum(e["new"] for e in journal) - len(requests) >= 1
    assert_replays_sound(run_dir)
