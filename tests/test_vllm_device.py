"""FSMWorker in the configuration GPU and NPU users run, emulated on vLLM's CPU platform
(`make test-vllm-device`: RUNNER_FSM_EMULATE_DEVICE=1 on the MRV2 leg's environment).

vLLM's CUDA default, put back by the emulation: Model Runner V2, its JIT warm-up through the
worker's `execute_model`, FULL_DECODE_ONLY graphs of sizes 1/2/4/8 (a replay reruns the captured
forward over the same buffers with every module hook off, as a device runs no Python) and async
scheduling. Each test fails on a worker that refuses the warm-up (`capturing -> prefill`), that
records graphs from its forward hook only (no hook runs in a replay), or whose start-up failures
leave no `fault` record.
"""

from __future__ import annotations

import pytest
from vllm_checks import assert_replays_sound, graph_records, records, transitions
from vllm_device_graphs import MinimalGraph

import vllm_harness as h

pytestmark = [pytest.mark.vllm, pytest.mark.device]

SIZES = [1, 2, 4, 8]
GREEDY = h.mixed_workload(num=10, seed=1)  # 10 requests > max_num_seqs=8; a 90-token prompt chunked
SEEDED = [h.Req(f"s{i}", tuple(range(5 + i, 12 + 2 * i)), 6, seed=100 + i) for i in range(5)]


def _kwargs(model_dir: str, *, worker: str | None = h.FSM_WORKER, run_dir=None, eager: bool = False, **extra):
    kw = h.llm_kwargs(model_dir, worker=worker, run_dir=run_dir, **extra)
    kw["enforce_eager"] = eager
    if not eager:
        kw["compilation_config"] = {"cudagraph_capture_sizes": SIZES}
    return kw


def _tokens(**kwargs) -> dict[str, list[int]]:
    with h.open_llm(**kwargs) as llm:
        greedy, _ = h.generate(llm, GREEDY)
        seeded, _ = h.generate(llm, SEEDED)
    return {**greedy, **seeded}


def _assert_graph_evidence(run_dir) -> tuple[int, int]:
    """Every replay after a `buffers` record of its step (reason `replay`), the captures of
    every size, the warm-up's steps under `capturing`; replay sound. (replays, decode steps)."""
    recs = records(run_dir)
    job = recs[0]
    emulation = job["device_emulation"]
    assert (emulation["cudagraph_mode"], emulation["capture_sizes"]) == ("FULL_DECODE_ONLY", SIZES)
    assert emulation["jit_warmup"] and emulation["async_scheduling"], emulation
    warmups = graph_records(run_dir, "warmup")
    assert warmups and all(r["step_id"] == -1 for r in warmups), warmups
    assert sorted(r["num_tokens"] for r in graph_records(run_dir, "capture")) == SIZES
    last_buffers = None
    replays = 0
    for r in recs:
        if r["event"] == "buffers":
            last_buffers = r
        elif r["event"] == "graph" and r["action"] == "replay":
            replays += 1
            assert last_buffers is not None and last_buffers["step_id"] == r["step_id"] \
                and last_buffers["reason"] == "replay", (r, last_buffers)
    decode_steps = transitions(run_dir).count("decode")
    assert_replays_sound(run_dir)
    return replays, decode_steps


def test_cuda_default_starts_and_gives_eager_tokens(vllm_models, tmp_path):
    """FSMWorker in the emulated CUDA default: the same tokens as vLLM's default worker there
    and as the eager run; at least half the decode steps replay a graph, each after its inputs'
    fingerprint. Fails on main before Part 26 (`StepRefused: 'prefill' is not allowed in state
    'capturing'` at the first warm-up step), and with `_warm_up_step` removed."""
    model = vllm_models["llama"]
    ours = _tokens(**_kwargs(model, run_dir=str(tmp_path / "fsm")))
    default = _tokens(**_kwargs(model, worker=None))
    eager = _tokens(**_kwargs(model, worker=None, eager=True))
    assert ours == default == eager
    replays, decode_steps = _assert_graph_evidence(tmp_path / "fsm")
    assert decode_steps and replays * 2 >= decode_steps, (replays, decode_steps)


def test_replay_records_come_from_the_graph_manager(vllm_models, tmp_path, monkeypatch):
    """With the emulation's graph class swapped for a minimal stand-in, the log holds one replay
    record per replay that ran: the records come from vLLM's graph manager calls (as on a
    device), not from the emulation. Fails with `MRV2Runner.attach_graphs` a no-op (no replay
    records, no capture records)."""
    monkeypatch.setenv("RUNNER_FSM_EMULATED_GRAPH", "vllm_device_graphs:MinimalGraph")
    MinimalGraph.replays = 0
    model = vllm_models["mixtral"]
    ours = _tokens(**_kwargs(model, run_dir=str(tmp_path / "fsm")))
    assert records(tmp_path / "fsm")[0]["device_emulation"]["graph_class"] == "vllm_device_graphs.MinimalGraph"
    replays, _ = _assert_graph_evidence(tmp_path / "fsm")
    assert replays == MinimalGraph.replays > 0
    monkeypatch.delenv("RUNNER_FSM_EMULATED_GRAPH")
    assert ours == _tokens(**_kwargs(model, worker=None, eager=True))


@pytest.mark.parametrize("where", ["warmup", "capture"])
def test_start_up_failure_is_a_fault_under_capturing(vllm_models, tmp_path, monkeypatch, where):
    """A failure in the JIT warm-up's second step, or in a graph capture, leaves a `fault`
    record at step -1 and the replica `faulted` from `capturing`; replay names it. Fails with
    the try/except of `compile_or_warm_up_model` removed (a bare raise: no fault record)."""
    import vllm.v1.worker.gpu.warmup as warmup

    if where == "warmup":
        real = warmup.warmup_kernels

        def failing_warmup(runner, execute_model, sample_tokens):
            calls = []

            def execute(scheduler_output):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("injected warm-up failure")
                return execute_model(scheduler_output)
            return real(runner, execute, sample_tokens)
        monkeypatch.setattr(warmup, "warmup_kernels", failing_warmup)
    else:
        monkeypatch.setenv("RUNNER_FSM_EMULATED_GRAPH", "vllm_device_graphs:FailingGraph")
    run_dir = tmp_path / where
    with pytest.raises(Exception):
        with h.open_llm(**_kwargs(vllm_models["llama"], run_dir=str(run_dir))):
            pass
    recs = records(run_dir)
    faults = [r for r in recs if r["event"] == "fault"]
    assert faults and faults[0]["step_id"] == -1 and f"injected {where.replace('warmup', 'warm-up')} failure" \
        in faults[0]["message"], faults
    moved = [(r["src"], r["dst"]) for r in recs if r["event"] == "transition" and r["trigger"] == "fault"]
    assert moved == [("capturing", "faulted")], moved
    assert [r["num_tokens"] for r in graph_records(run_dir, "warmup")][:1] == [16] or where == "capture"

    from runner_fsm.replay.judge import replay

    report = replay(run_dir)
    assert not report.sound
    first = report.verdicts[0]
    assert (first.kind, first.step, first.replica) == ("fault", -1, 0), report.format()


class _HostSyncs:
    """Counts the calls that make a device host wait: `item`, `tolist`, `.cpu()`, `nonzero` (a
    TorchFunctionMode sees every tensor method called from Python) and `synchronize`."""

    NAMES = ("item", "tolist", "cpu", "nonzero", "synchronize")

    def __init__(self, monkeypatch):
        from collections import Counter

        import torch
        from torch.overrides import TorchFunctionMode

        self.counts = Counter()
        counts = self.counts
        self.active = False  # counted inside `with self:` only (start-up and shutdown synchronise too)
        syncs = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _HostSyncs.NAMES and syncs.active:
                    counts[name] += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        for owner in (torch.cuda, torch.accelerator):
            real = owner.synchronize

            def synchronize(*args, _real=real, **kwargs):
                if syncs.active:
                    counts["synchronize"] += 1
                return _real(*args, **kwargs) if torch.cuda.is_available() else None
            monkeypatch.setattr(owner, "synchronize", synchronize)

    def __enter__(self):
        self.active = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.active = False
        return self.mode.__exit__(*exc)


def test_no_host_synchronisation_added_per_step(vllm_models, tmp_path, monkeypatch):
    """The calls that synchronise a device with its host, counted over the same greedy
    workload (decode steps replaying graphs), are as many under FSMWorker (audit `full`:
    every forward fingerprinted) as under vLLM's default worker. Fails with a `.tolist()` or
    `.item()` of a fingerprint per forward (e.g. `probe.resolve` called in `_graph_forward`)."""
    model = vllm_models["llama"]
    counted = {}
    for name, worker in (("default", None), ("fsm", h.FSM_WORKER)):
        syncs = _HostSyncs(monkeypatch)
        run_dir = tmp_path / name
        with h.open_llm(**_kwargs(model, worker=worker, run_dir=str(run_dir) if worker else None)) as llm:
            with syncs:
                tokens, _ = h.generate(llm, GREEDY)
        counted[name] = (dict(syncs.counts), tokens)
        monkeypatch.undo()
    assert counted["fsm"] == counted["default"], counted
    replays, decode_steps = _assert_graph_evidence(tmp_path / "fsm")
    assert replays * 2 >= decode_steps > 0


def test_idle_replica_replays_graphs_under_dp(tmp_path):
    """DP=2 (Mixtral, one process per replica): replica 1 runs out of work and runs idle dummy
    steps that replay a FULL graph, each after a `buffers` record of its step, as replica 0's
    decode steps do; each agreement logs every replica's requested graph mode and vLLM's agreed
    one (FULL, every count padded to the graph); tokens equal DP=1 eager on vLLM's own worker.
    Fails with `graph_decision` left out (the agreement then logs eager for a step that replayed)."""
    import vllm_dp_cases as c

    from runner_fsm.integrations.vllm.offline_dp import Job

    models = c.make_models(tmp_path / "models")
    run_dir = tmp_path / "run"
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": SIZES}}
    dp2 = c.run([Job({**c.kwargs(models, "mixtral", drafting=False, run_dir=str(run_dir), executor=c.VLLM_DEFAULT_LAYOUT),
                      **graphs}, c.PER_RANK)], 2, tmp_path)
    dp1 = c.run([Job(c.kwargs(models, "mixtral", drafting=False, worker=None), [c.ALL])], 1, tmp_path)
    assert dp2.codes == [0, 0] and dp1.codes == [0], (dp2.logs[-1][-3000:], dp1.logs[-1][-3000:])
    merged = {rid: toks for per_rank in dp2.outputs[0] for rid, toks in per_rank.items()}
    assert merged == dp1.outputs[0][0]
    assert_replays_sound(run_dir)
    for rank, kind in ((0, "decode"), (1, "idle")):
        recs = records(run_dir, rank)
        steps = [r["step_id"] for r in recs if r["event"] == "transition" and r["trigger"] == kind]
        replayed = {r["step_id"] for r in graph_records(run_dir, "replay", rank) if r["dummy"] == (kind == "idle")}
        assert len(steps) >= 5 and set(steps) <= replayed, (rank, steps, replayed)
        buffers = {r["step_id"] for r in recs if r["event"] == "buffers" and r["reason"] == "replay"}
        assert replayed <= buffers
        agreed = {r["step_id"]: r["agreed"] for r in recs if r["event"] == "collective" and "agreed" in r}
        for step in steps:
            assert agreed[step]["graph_mode"] == 2 and agreed[step]["requested_graph_modes"] == [2, 2], agreed[step]
            assert len(set(agreed[step]["num_tokens_across_dp"])) == 1, agreed[step]


def test_any_warm_up_through_execute_model_is_recorded_as_warm_up(vllm_models, tmp_path, monkeypatch):
    """FlashInfer's attention warm-up (`kernel_warmup` -> `mixed_batch_attention_warmup`) calls the
    worker's `execute_model` with a mixed prefill+decode batch, whatever `enable_jit_warmup`
    says; here vLLM's own function runs where the JIT warm-up would (a CPU stand-in for the CUDA
    worker's call). Its steps are `warmup` records under `capturing` (2 tokens, then a mixed
    16), the run starts and gives the eager tokens, sound. Fails if the worker takes a warm-up
    step for a step of the run (refused in `capturing`)."""
    import vllm.v1.worker.gpu.warmup as warmup
    from vllm.model_executor.warmup.attention_warmup import mixed_batch_attention_warmup

    def attention_warmup_only(runner, execute_model, sample_tokens):
        mixed_batch_attention_warmup(execute_model.__self__, 16)  # the worker: FSMWorker
    monkeypatch.setattr(warmup, "warmup_kernels", attention_warmup_only)
    model = vllm_models["llama"]
    ours = _tokens(**_kwargs(model, run_dir=str(tmp_path / "fsm")))
    assert [r["num_tokens"] for r in graph_records(tmp_path / "fsm", "warmup")] == [2, 16]
    assert records(tmp_path / "fsm")[0]["device_emulation"]["jit_warmup"]
    assert_replays_sound(tmp_path / "fsm")
    assert ours == _tokens(**_kwargs(model, worker=None, eager=True))


def test_mla_under_pcp_warms_up_through_the_worker(tmp_path):
    """A tiny DeepSeek-V2 (MLA + MoE) at PCP=2 in the emulated device configuration: vLLM's JIT
    warm-up runs through FSMWorker on both PCP ranks (recorded as warm-up), async scheduling with
    vLLM's multiprocess executor (two worker processes),
    and the tokens equal Hugging Face's greedy ones while decode steps replay FULL graphs (the
    emulation declares graph support for the CPU MLA backend), each after a `buffers` record of
    the PCP manager's buffers it reads, as staged at its capture; replay sound. Fails with the
    capture record taken of the runner's own buffers (`graph_inputs` without its PCP branch):
    replay then reports `stale_buffer_replay` at every replay (storage moved since capture)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_vllm_mla_pcp import NEW_TOKENS, PROMPTS as ALL_PROMPTS
    from vllm_checks import hf_greedy

    from runner_fsm.testing.vllm_models import make_model

    # One request: under PCP vLLM replays its decode steps (with several, it ran them eager here)
    PROMPTS = {"long": ALL_PROMPTS["long"]}
    model = make_model(tmp_path / "deepseek_v2", "deepseek_v2", seed=3)
    run_dir = tmp_path / "pcp2"
    llm = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": SIZES}}
    spec = {"model": model, "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
            "runs": [{"name": "pcp2", "pcp": 2, "run_dir": str(run_dir), "options": None, "llm": llm}]}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    child = subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_mla_child.py"), json.dumps(spec)],
                           capture_output=True, text=True, env=env, timeout=1200)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-4000:]
    result = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["pcp2"]["tokens"] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    for rank in (0, 1):
        emulation = records(run_dir, rank)[0]["device_emulation"]
        assert emulation["jit_warmup"] and emulation["async_scheduling"], emulation
        assert emulation["executor"] == "mp", emulation  # async scheduling with the multiprocess executor
        assert graph_records(run_dir, "warmup", rank), rank
        assert sorted(r["num_tokens"] for r in graph_records(run_dir, "capture", rank)) == SIZES
        replayed = {r["step_id"] for r in graph_records(run_dir, "replay", rank)}
        buffers = {r["step_id"] for r in records(run_dir, rank) if r["event"] == "buffers" and r["reason"] == "replay"}
        assert replayed and replayed <= buffers, (rank, replayed, buffers)
    assert_replays_sound(run_dir)


def test_mtp_under_dp_and_pcp_in_the_device_configuration(tmp_path):
    """The project's own case, DP=2 x PCP=2 with MTP drafts (four processes), in the emulated
    device configuration, replica 1 idle while replica 0 decodes: the JIT warm-up runs through
    FSMWorker on every rank (warm-up records), async scheduling; the tokens equal Hugging Face's
    greedy ones; replay sound (no `graph_mode_demoted`).

    Whether vLLM demotes every replica when one idles (Part 31): not here. The idle replica's
    dummy asks for the busy replica's uniform token count (2: one token and one draft a request),
    so the counts agree; and the emulated CPU MLA backend captures single-token decode graphs
    only, so the busy replica asks for eager itself at every MTP decode step (vLLM's own column
    in its agreement: cg_mode 0), as on a CUDA backend of that support: no graph to lose."""
    import vllm_dp_cases as c
    from vllm_checks import hf_greedy

    from runner_fsm.integrations.vllm.offline_dp import Job
    from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_mtp_model

    model = make_mtp_model(tmp_path / "mtp_moe", moe=True, seed=3)
    run_dir = tmp_path / "run"
    kw = h.llm_kwargs(model, run_dir=str(run_dir), block_size=MLA_BLOCK_SIZE, max_num_batched_tokens=256,
                      prefill_context_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                      runner_fsm={"collective_timeout_s": 60}, enforce_eager=False,
                      compilation_config={"cudagraph_capture_sizes": SIZES})
    result = c.run([Job(kw, c.PER_RANK)], 2, tmp_path, timeout_s=900, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"})
    assert result.codes == [0, 0], result.logs[-1][-4000:]
    merged = {rid: toks for per_rank in result.outputs[0] for rid, toks in per_rank.items()}
    assert merged == {rid: hf_greedy(model, {rid: list(prompt)}, n)[rid] for rid, prompt, n in c.ALL}
    for rank in range(4):
        assert graph_records(run_dir, "warmup", rank), rank
        assert records(run_dir, rank)[0]["device_emulation"]["async_scheduling"]
    report = assert_replays_sound(run_dir)
    assert not [v for v in report.verdicts if v.kind == "graph_mode_demoted"]
    # what each replica asked of vLLM's target DP sync, by step: (kind, vLLM's column)
    asked = [{r["step_id"]: (r.get("kind", "real"), r["sent"]["vllm"]) for r in records(run_dir, rank)
              if r["event"] == "collective" and r["group"] == "dp" and r["stage"] == "enqueue" and r["phase"] == 1}
             for rank in (0, 2)]  # PCP rank 0 of replica 0, of replica 1
    idle = [step for step, (kind, _) in asked[1].items() if kind == "dummy"]
    assert len(idle) >= 5, asked[1]
    for step in idle:
        busy, dummy = asked[0][step][1], asked[1][step][1]  # [num_tokens, cg_mode, uniform count, ...]
        assert asked[0][step][0] == "real" and busy[2] == dummy[2] == 2, (step, busy, dummy)
        assert busy[1] == 0, (step, busy)  # the busy replica asked for eager itself
