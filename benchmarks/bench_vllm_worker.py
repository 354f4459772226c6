"""FSMWorker vs vLLM's default CPU worker on one workload: throughput ratio and the wrapper's
own time per step.

Same model (a random Llama made with transformers; `--arch` for Mixtral or Qwen3-MoE), same
requests (greedy, ignore_eos), same engine settings (float32, eager), same run of this script.
Each measurement is a fresh process (vLLM's CPU worker binds threads process-wide); workers
alternate (default, fsm, default, fsm, ...) so drift of a shared machine hits both, and the
throughput ratio is of the medians of their wall times. In each process, after a warm-up:
1. `LLM.generate` on the workload is timed (wall): the throughput;
2. timers are put around the worker's calls (`execute_model`, `sample_tokens`,
   `take_draft_token_ids`, `execute_dummy_batch`) and around the model runner's same calls,
   plus forward pre-hooks before and after the worker's own; the workload runs again and each
   step's layer time is (worker call - runner call) + (time in the forward pre-hook), thread
   CPU time. For vLLM's default worker that is its own thin layer (and the timers).
3. In FSMWorker's process, vLLM's worker calls that FSMWorker's methods make (super()) are
   timed too: each step's wrapper time is FSMWorker's calls minus those, plus its forward
   pre-hook. That is the wrapper's own time, paired step by step in one process; the
   difference of the two layers' means, from different processes, is reported beside it
   (one process's figure differs from the next one's by up to half on this machine).
The per-step figures are means (with the median, p90 and p99 beside them) over a window of a
whole number of the journal's batches (`journal.BATCH` steps, 32), the timed run's first steps:
the journal renders its entries once a batch, in the step that completes one, and a median, or
a window that leaves that step out, hides it (a run of fewer than 32 steps: all its steps). In
FSMWorker's process the renders inside the window are counted and must be one per batch. Means
add up: the split by call is each call's mean per step, and the ratio to vLLM's worker layer is
of the two means (pooled over the processes: the same workload gives each the same window),
its spread that of the rounds' ratios of means.
FSMWorker runs twice per round: with the full audit and with `audit=transitions` (no
per-forward buffers records). Outputs of all runs must be equal. OMP_NUM_THREADS=1 for both (vLLM's CPU serving setting;
more threads than free cores make spin-waiting OpenMP times swing on a shared machine).

    .venv-vllm/bin/python benchmarks/bench_vllm_worker.py [--requests 32] [--max-new 32] [--repeats 2]
        [--runner v1|mrv2|device]

`--tp 2`: both workers at tensor_parallel_size 2 (vLLM's `mp` executor, one process per TP rank,
`VLLM_CPU_OMP_THREADS_BIND=0|1`): throughput only, with the full audit (the timers of step 2
and 3 live in one worker process).

`--runner device` is MRV2 in the device configuration the project emulates on the CPU
(RUNNER_FSM_EMULATE_DEVICE=1: graphs, JIT warm-up, async scheduling; docs/vllm.md).
`--runner mrv2`: vLLM's Model Runner V2 for both workers, as the MRV2 test leg runs it on this
CPU (VLLM_USE_V2_MODEL_RUNNER=1, Triton's interpreter for MRV2's kernels, the stand-in backend
of tests/vllm_site): the interpreter slows vLLM's own step, not the wrapper's, so the ratio is
conservative there and the wrapper's own time per step is the figure to read.

Prints one `SUITE_ROW {json}` line per row for benchmarks/run_all.py and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FSM = "runner_fsm.integrations.vllm.FSMWorker"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # vllm_harness: the vLLM test tier's engine settings
sys.path.insert(0, str(REPO))  # this checkout's runner_fsm, also when the venv has another installed
WORKER_CALLS = ("execute_model", "sample_tokens", "take_draft_token_ids", "execute_dummy_batch")
RUNNER_CALLS = {"execute_model": "execute_model", "sample_tokens": "sample_tokens",
                "take_draft_token_ids": "take_draft_token_ids", "execute_dummy_batch": "_dummy_run"}


def _workload(vocab: int, num: int, max_new: int, seed: int):
    import numpy as np

    from vllm_harness import Req

    rng = np.random.default_rng(seed)
    return [Req(f"r{i}", tuple(int(t) for t in rng.integers(3, vocab, int(rng.integers(16, 129)))), max_new)
            for i in range(num)]


def _install_timers(worker) -> list:
    """Per step: [layer ns] and, in FSMWorker's process, [wrapper ns]; a step starts at each
    execute_model with scheduled tokens. Per call: [(step index, own ns)] (-1 before the first
    step); in FSMWorker's process, the step indices where its journal rendered a batch."""
    import torch

    clock = time.thread_time_ns
    steps: list[int] = []
    wrapper_steps: list[int] = []
    by_call: dict[str, list[tuple[int, int]]] = {}  # own time per call (and per forward pre-hook)
    # FSMWorker's own time per call, paired; its forward pre-hook is the wrapper's alone
    wrapper_by_call: dict[str, list[tuple[int, int]]] = {"forward hook": by_call.setdefault("forward hook", [])}
    renders: list[int] = []
    runner = worker.model_runner
    inner = {"ns": 0, "base": 0}

    def timed_inner(fn):
        def call(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                inner["ns"] += clock() - start
        return call

    def timed_outer(name, fn):
        def call(*args, **kwargs):
            if name == "execute_model" and args and args[0].total_num_scheduled_tokens:
                steps.append(0)
                wrapper_steps.append(0)
            inner["ns"] = inner["base"] = 0
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total = clock() - start
                own = total - inner["ns"]
                step = len(steps) - 1
                by_call.setdefault(name, []).append((step, own))
                if hook["ns"]:
                    by_call.setdefault("forward hook", []).append((step, hook["ns"]))
                own += hook["ns"]
                # FSMWorker's own code: its call minus vLLM's worker call inside it (super()),
                # plus its forward pre-hook; 0 where FSMWorker does not override the call.
                wrapper = (total - inner["base"] if inner["base"] else 0) + hook["ns"]
                if inner["base"]:
                    wrapper_by_call.setdefault(name, []).append((step, total - inner["base"]))
                hook["ns"] = 0
                if steps:
                    steps[-1] += own
                    wrapper_steps[-1] += wrapper
        return call

    def timed_base(fn):
        # A function on vLLM's worker class, so that FSMWorker's super() calls reach it.
        def call(self, *args, **kwargs):
            start = clock()
            try:
                return fn(self, *args, **kwargs)
            finally:
                inner["base"] += clock() - start
        return call

    hook = {"ns": 0, "start": 0}
    model = runner.model
    if isinstance(model, torch.nn.Module):  # the worker's own pre-hook runs between these two
        def first(_m, _a, _k):
            hook["start"] = clock()

        def last(_m, _a, _k):
            hook["ns"] += clock() - hook["start"]
        model.register_forward_pre_hook(first, with_kwargs=True, prepend=True)
        model.register_forward_pre_hook(last, with_kwargs=True)
    # collective_rpc hands vLLM's WorkerWrapperBase, which holds the worker it made
    vllm_worker_cls = _vllm_worker_class(type(getattr(worker, "worker", worker)))
    recorder = getattr(getattr(worker, "worker", worker), "recorder", None)
    journal = getattr(recorder, "journal", None)
    if vllm_worker_cls is not None and journal is not None:  # which step renders a batch of its entries
        def counted(render=journal.render):
            renders.append(len(steps) - 1)
            return render()
        journal.render = counted
    for name in WORKER_CALLS:
        setattr(runner, RUNNER_CALLS[name], timed_inner(getattr(runner, RUNNER_CALLS[name])))
        if vllm_worker_cls is not None:  # FSMWorker: time vLLM's worker call its method makes
            owner = next(c for c in vllm_worker_cls.__mro__ if name in c.__dict__)
            setattr(vllm_worker_cls, name, timed_base(owner.__dict__[name]))
        setattr(worker, name, timed_outer(name, getattr(worker, name)))
    worker._bench_steps = steps
    worker._bench_wrapper_steps = wrapper_steps if vllm_worker_cls is not None else []
    worker._bench_by_call = by_call
    worker._bench_wrapper_by_call = wrapper_by_call if vllm_worker_cls is not None else {}
    worker._bench_renders = renders
    return []


def _window(steps: int) -> int:
    """How many of the timed run's first steps the per-step figures cover: a whole number of the
    journal's batches, or every step of a run shorter than one batch."""
    from runner_fsm.integrations.vllm.recording.journal import BATCH

    return steps // BATCH * BATCH or steps


def _figures(ns: list[int], prefix: str) -> dict:
    """Mean, median, p90 and p99 (us) of per-step ns, as `{prefix}_mean`, ..."""
    if not ns:
        return {f"{prefix}_{k}": None for k in ("mean", "median", "p90", "p99")}
    ranked = sorted(ns)
    return {f"{prefix}_mean": statistics.fmean(ns) / 1e3, f"{prefix}_median": statistics.median(ns) / 1e3,
            f"{prefix}_p90": ranked[int(0.9 * (len(ns) - 1))] / 1e3,
            f"{prefix}_p99": ranked[int(0.99 * (len(ns) - 1))] / 1e3}


def _by_call(calls: dict[str, list[tuple[int, int]]], window: int) -> dict[str, dict[str, float]]:
    """Per call: its mean per step over the window's steps (the means add up to the step's) and
    the median of its calls there (us)."""
    out = {}
    for name, timed in calls.items():
        ns = [t for step, t in timed if 0 <= step < window]
        if ns and window:
            out[name] = {"mean": sum(ns) / window / 1e3, "median": statistics.median(ns) / 1e3}
    return out


def _vllm_worker_class(cls: type) -> type | None:
    """The vLLM worker class FSMWorker wraps (its base after the mixin); None for vLLM's own."""
    from runner_fsm.integrations.vllm.worker import FSMWorkerMixin

    if not issubclass(cls, FSMWorkerMixin):
        return None
    return next(c for c in cls.__mro__ if c is not cls and not issubclass(c, FSMWorkerMixin))


def _child(args) -> None:
    import vllm_harness as h

    worker = None if args.worker == "default" else FSM
    options = {"audit": "transitions"} if args.worker == "fsm-transitions" else {}
    requests = _workload(args.vocab, args.requests, args.max_new, args.seed)
    warmup = _workload(args.vocab, 4, 4, args.seed + 1)
    run_dir = str(Path(args.out).with_suffix("")) + "-run"
    graphs = {}
    if os.environ.get("RUNNER_FSM_EMULATE_DEVICE") == "1":  # `--runner device`
        graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}}
    kwargs = h.llm_kwargs(args.model_dir, worker=worker, run_dir=run_dir if worker else None,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                          max_model_len=512, kv_cache_memory_bytes=256 << 20, runner_fsm=options,
                          tensor_parallel_size=args.tp, **graphs)
    with h.open_llm(**kwargs) as llm:
        h.generate(llm, warmup)
        cpu = time.process_time()
        outputs, elapsed = h.generate(llm, requests)
        cpu = time.process_time() - cpu
        if args.tp > 1:  # the workers are other processes: throughput only
            Path(args.out).write_text(json.dumps({"worker": args.worker, "elapsed_s": elapsed, "cpu_s": cpu,
                                                  "outputs": outputs, "again_equal": True, "steps": None,
                                                  "output_tokens": sum(map(len, outputs.values()))}))
            return
        h.worker_call(llm, _install_timers)
        again, _ = h.generate(llm, requests)
        (own,) = h.worker_call(llm, lambda w: list(w._bench_steps))
        (by_call,) = h.worker_call(llm, lambda w: dict(w._bench_by_call))
        (wrapper,) = h.worker_call(llm, lambda w: list(w._bench_wrapper_steps))
        (wrapper_by_call,) = h.worker_call(llm, lambda w: dict(w._bench_wrapper_by_call))
        (renders,) = h.worker_call(llm, lambda w: list(w._bench_renders))
    steps = len(own)
    window = _window(steps)
    from runner_fsm.integrations.vllm.recording.journal import BATCH

    renders_in = sum(1 for step in renders if 0 <= step < window)
    if wrapper and window % BATCH == 0 and renders_in != window // BATCH:
        raise SystemExit(f"{renders_in} journal renders in the {window}-step window, not one per {BATCH} steps:"
                         " the window would not be a whole number of the journal's batches")
    own_split, wrapper_split = _by_call(by_call, window), _by_call(wrapper_by_call, window)
    Path(args.out).write_text(json.dumps({
        "worker": args.worker, "elapsed_s": elapsed, "cpu_s": cpu, "outputs": outputs, "again_equal": again == outputs,
        "output_tokens": sum(map(len, outputs.values())), "steps": steps, "window_steps": window,
        "journal_renders_in_window": renders_in if wrapper else None,
        **_figures(own[:window], "own_us"), **_figures(wrapper[:window], "wrapper_us"),
        "own_us_by_call_mean": {name: f["mean"] for name, f in own_split.items()},
        "own_us_by_call_median": {name: f["median"] for name, f in own_split.items()},
        "wrapper_us_by_call_mean": {name: f["mean"] for name, f in wrapper_split.items()},
        "wrapper_us_by_call_median": {name: f["median"] for name, f in wrapper_split.items()},
    }))


def _measure(args, worker: str, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", worker, "--out", str(out), "--model-dir", args.model_dir,
           "--requests", str(args.requests), "--max-new", str(args.max_new), "--seed", str(args.seed),
           "--vocab", str(args.vocab), "--budget", str(args.budget), "--max-num-seqs", str(args.max_num_seqs),
           "--tp", str(args.tp)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(args.threads))
    if args.tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp))
    paths = [str(REPO)]
    if args.runner in ("mrv2", "device"):
        env.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1")
        paths.append(str(REPO / "tests" / "vllm_site"))
        if args.runner == "device":  # the device configuration, emulated (docs/vllm.md)
            env["RUNNER_FSM_EMULATE_DEVICE"] = "1"
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        code = subprocess.call(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{worker} run failed ({code}); see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def _tp_summary(args, runs: dict, wall: dict, same: bool) -> None:
    """The throughput row at `--tp` > 1, and its JSON summary."""
    tokens = runs["fsm"][0]["output_tokens"]
    ratio = wall["default"] / wall["fsm"]
    row = dict(name=f"FSMWorker in vLLM vs default CPU worker, TP={args.tp}",
               figure=f"FSMWorker {tokens / wall['fsm']:,.0f} tok/s",
               baseline=f"default worker {tokens / wall['default']:,.0f} tok/s", ratio=f"{ratio:.3f}x",
               target=">= 0.95x", status="error" if not same else ("pass" if ratio >= 0.95 else "miss"),
               note=(f"random {args.arch}, hidden {args.hidden}, {args.layers} layers, tensor_parallel_size"
                     f" {args.tp} (one worker process per TP rank); {args.requests} requests x {args.max_new} new"
                     f" tokens, {args.repeats} fresh processes per worker, interleaved; full audit; outputs "
                     + ("equal" if same else "DIFFER")))
    print("SUITE_ROW " + json.dumps(row), flush=True)
    print(json.dumps({"tp": args.tp, "arch": args.arch, "default_s": wall["default"], "fsm_s": wall["fsm"],
                      "throughput_ratio_fsm_over_default": ratio, "outputs_equal": same}, indent=1))
    if not same:
        raise SystemExit("outputs differ between workers or runs")


def _own_time_row(level: str, worker: str, runs: dict, wrapper: dict, own: dict, on: str, status, note: str) -> dict:
    """FSMWorker's own time per step over vLLM's own worker layer (issue 37's target: <= 1.0x),
    a ratio of means. Each round pairs a default-worker process with the FSMWorker process after
    it (interleaved): the spread is over those rounds' ratios of means."""
    ratio = wrapper[worker]["mean"] / own["default"]["mean"]
    rounds = [f["wrapper_us_mean"] / d["own_us_mean"] for d, f in zip(runs["default"], runs[worker])]
    return dict(name=f"FSMWorker's own time per vLLM step / vLLM's worker layer, {level}{on}",
                figure=f"{wrapper[worker]['mean']:.1f} us mean, {wrapper[worker]['median']:.1f} us median"
                       " (thread CPU, paired)",
                baseline=f"vLLM's worker layer {own['default']['mean']:.1f} us mean,"
                         f" {own['default']['median']:.1f} us median",
                ratio=f"{ratio:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]",
                target="<= 1.0x", status=status or ("pass" if ratio <= 1.0 else "miss"),
                note=f"{note}; means over {_windows(runs[worker])}; p90 {wrapper[worker]['p90']:.1f} us,"
                     f" p99 {wrapper[worker]['p99']:.1f} us (median over processes)")


def _pooled(results: list[dict], prefix: str) -> dict[str, float]:
    """A worker's per-step figures over its processes: the mean pooled over every window step
    (each process's mean weighted by its window), the median, p90 and p99 as the median of the
    processes' own."""
    steps = sum(r["window_steps"] for r in results)
    return {"mean": sum(r[f"{prefix}_mean"] * r["window_steps"] for r in results) / steps,
            **{k: statistics.median(r[f"{prefix}_{k}"] for r in results) for k in ("median", "p90", "p99")}}


def _windows(results: list[dict]) -> str:
    """What the means cover: "the first 64 of 70 steps of each process (2 journal batches, 2
    renders), 3 processes"."""
    from runner_fsm.integrations.vllm.recording.journal import BATCH

    def count(n: int, one: str, many: str) -> str:
        return f"{n} {one if n == 1 else many}"

    first = results[0]
    window, renders = first["window_steps"], first.get("journal_renders_in_window")
    processes = count(len(results), "process", "processes")
    if window % BATCH:  # a run shorter than a batch: every step
        return f"all {window} steps of each process (under one journal batch), {processes}"
    return (f"the first {window} of {first['steps']} steps of each process"
            f" ({count(window // BATCH, 'journal batch', 'journal batches')}"
            + (f", {count(renders, 'render', 'renders')}" if renders is not None else "") + f"), {processes}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a checkpoint directory (default: a random one of --arch)")
    p.add_argument("--arch", default="llama", choices=("llama", "mixtral", "qwen3_moe"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="measurements per worker (alternating)")
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both workers")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--runner", default="v1", choices=("v1", "mrv2", "device"),
                   help="vLLM's model runner for both workers; device: MRV2 in the emulated device configuration"
                        " (JIT warm-up, FULL_DECODE_ONLY graphs of 1-16 tokens, async scheduling)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size for both workers (throughput only)")
    p.add_argument("--child", choices=("default", "fsm", "fsm-transitions"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.worker = args.child
        _child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if args.model_dir is None:
        from runner_fsm.testing.vllm_models import make_model

        args.model_dir = make_model(work / "model", args.arch, seed=0, hidden_size=args.hidden,
                                    intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                    num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                                    head_dim=64)
    runs: dict[str, list[dict]] = {"default": [], "fsm": []} if args.tp > 1 else \
        {"default": [], "fsm": [], "fsm-transitions": []}
    for i in range(args.repeats):
        for worker in runs:
            result = _measure(args, worker, work / f"{worker}-{i}.json")
            runs[worker].append(result)
            if args.tp > 1:
                print(f"{worker:8s} run {i}: {result['elapsed_s']:.3f} s wall, {result['output_tokens']} tokens",
                      flush=True)
                continue
            print(f"{worker:8s} run {i}: {result['elapsed_s']:.3f} s wall, {result['cpu_s']:.3f} s cpu,"
                  f" {result['output_tokens']} tokens, {result['steps']} steps (window {result['window_steps']}),"
                  f" layer time per step mean {result['own_us_mean']:.1f} us, median {result['own_us_median']:.1f}"
                  f" (p90 {result['own_us_p90']:.1f}, p99 {result['own_us_p99']:.1f})"
                  + (f", wrapper's own mean {result['wrapper_us_mean']:.1f} us,"
                     f" median {result['wrapper_us_median']:.1f}"
                     f" (p90 {result['wrapper_us_p90']:.1f}, p99 {result['wrapper_us_p99']:.1f};"
                     f" {result['journal_renders_in_window']} journal renders in the window)"
                     if result["wrapper_us_median"] is not None else ""),
                  flush=True)
    reference = runs["default"][0]["outputs"]
    same = all(r["outputs"] == reference and r["again_equal"] for rs in runs.values() for r in rs)
    wall = {w: statistics.median(r["elapsed_s"] for r in rs) for w, rs in runs.items()}
    if args.tp > 1:
        return _tp_summary(args, runs, wall, same)
    cpu = {w: statistics.median(r["cpu_s"] for r in rs) for w, rs in runs.items()}
    own = {w: _pooled(rs, "own_us") for w, rs in runs.items()}
    # The wrapper's own time, paired: in FSMWorker's process, step by step, its calls minus
    # vLLM's worker calls inside them. The other figure, FSMWorker's layer minus the default
    # worker's, subtracts means of different processes, which differ by up to half here.
    wrapper = {w: _pooled(runs[w], "wrapper_us") for w in ("fsm", "fsm-transitions")}
    # Where the wrapper's time goes: per call, its mean per step, pooled over the processes
    # (the calls' means add up to the step's).
    calls = {worker: ["execute_model", "forward hook", "sample_tokens"]
             + sorted({name for r in runs[worker] for name in r["wrapper_us_by_call_mean"]}
                      - {"execute_model", "forward hook", "sample_tokens"})
             for worker in ("fsm", "fsm-transitions")}
    split = {worker: {name: sum(r["wrapper_us_by_call_mean"].get(name, 0.0) * r["window_steps"] for r in runs[worker])
                      / sum(r["window_steps"] for r in runs[worker])
                      for name in calls[worker]}
             for worker in ("fsm", "fsm-transitions")}
    split_median = {worker: {name: statistics.median(r["wrapper_us_by_call_median"].get(name, 0.0)
                                                     for r in runs[worker])
                             for name in ("execute_model", "forward hook", "sample_tokens")}
                    for worker in ("fsm", "fsm-transitions")}
    tokens = runs["fsm"][0]["output_tokens"]
    ratio = wall["default"] / wall["fsm"]
    summary = {
        "arch": args.arch, "runner": args.runner, "model_dir": args.model_dir, "requests": args.requests, "max_new_tokens": args.max_new,
        "omp_num_threads": args.threads, "repeats": args.repeats, "output_tokens": tokens,
        "steps": runs["fsm"][0]["steps"], "default_s": wall["default"], "fsm_s": wall["fsm"],
        "default_tok_per_s": tokens / wall["default"], "fsm_tok_per_s": tokens / wall["fsm"],
        "default_ms_per_step": 1e3 * wall["default"] / runs["default"][0]["steps"],
        "throughput_ratio_fsm_over_default": ratio,
        "cpu_time_ratio_default_over_fsm": cpu["default"] / cpu["fsm"],
        "window_steps": runs["fsm"][0]["window_steps"],
        "fsm_layer_us_per_step_mean": own["fsm"]["mean"], "default_layer_us_per_step_mean": own["default"]["mean"],
        "fsm_layer_us_per_step_median": own["fsm"]["median"],
        "default_layer_us_per_step_median": own["default"]["median"],
        "wrapper_own_us_per_step_mean": wrapper["fsm"]["mean"],
        "wrapper_own_us_per_step_mean_audit_transitions": wrapper["fsm-transitions"]["mean"],
        "wrapper_own_us_per_step_median": wrapper["fsm"]["median"],
        "wrapper_own_us_per_step_median_audit_transitions": wrapper["fsm-transitions"]["median"],
        "wrapper_own_us_per_step_p90": wrapper["fsm"]["p90"], "wrapper_own_us_per_step_p99": wrapper["fsm"]["p99"],
        "wrapper_own_us_per_step_p90_audit_transitions": wrapper["fsm-transitions"]["p90"],
        "wrapper_own_us_per_step_p99_audit_transitions": wrapper["fsm-transitions"]["p99"],
        "own_time_ratio_of_means": wrapper["fsm"]["mean"] / own["default"]["mean"],
        "own_time_ratio_of_means_audit_transitions": wrapper["fsm-transitions"]["mean"] / own["default"]["mean"],
        "layer_difference_us_per_step_mean": own["fsm"]["mean"] - own["default"]["mean"],
        "layer_difference_us_per_step_mean_audit_transitions": own["fsm-transitions"]["mean"] - own["default"]["mean"],
        "layer_difference_us_per_step_median": own["fsm"]["median"] - own["default"]["median"],
        "layer_difference_us_per_step_median_audit_transitions":
            own["fsm-transitions"]["median"] - own["default"]["median"],
        "wrapper_own_us_by_call_mean": split["fsm"],
        "wrapper_own_us_by_call_mean_audit_transitions": split["fsm-transitions"],
        "wrapper_own_us_by_call_median": split_median["fsm"],
        "wrapper_own_us_by_call_median_audit_transitions": split_median["fsm-transitions"],
        "throughput_ratio_audit_transitions": wall["default"] / wall["fsm-transitions"],
        "outputs_equal": same, "work_dir": str(work),
    }
    shape = f"random {args.arch}, hidden {args.hidden}, {args.layers} layers"
    on = {"v1": "", "mrv2": " (MRV2)", "device": " (MRV2, device configuration emulated)"}[args.runner]
    if args.runner in ("mrv2", "device"):
        shape += "; Model Runner V2 under Triton's interpreter (vLLM's own step slowed, not the wrapper's)"
    if args.runner == "device":
        shape += ("; the device configuration emulated on the CPU (JIT warm-up, FULL_DECODE_ONLY graphs of 1-16"
                  " tokens replayed by rerunning the captured forward, async scheduling); a replay's records are"
                  " taken inside vLLM's run_fullgraph call, counted in vLLM's layer here, not in the own time")
    status = "error" if not same else None
    rows = [
        dict(name="FSMWorker in vLLM vs default CPU worker" + on, figure=f"FSMWorker {tokens / wall['fsm']:,.0f} tok/s",
             baseline=f"default worker {tokens / wall['default']:,.0f} tok/s", ratio=f"{ratio:.3f}x",
             target=">= 0.95x", status=status or ("pass" if ratio >= 0.95 else "miss"),
             note=(f"{shape}; {args.requests} requests x {args.max_new} new tokens, {args.repeats} fresh processes"
                   f" per worker, interleaved; {summary['default_ms_per_step']:.1f} ms/step; process CPU time"
                   f" default/FSMWorker {cpu['default'] / cpu['fsm']:.3f}x (steadier than wall time on a shared"
                   f" machine); outputs "
                   + ("equal" if same else "DIFFER"))),
        _own_time_row("audit=transitions", "fsm-transitions", runs, wrapper, own, on, status,
                      "the cheaper audit level: transitions and journal, no per-forward buffers records;"
                      " layer difference between processes (means)"
                      f" {own['fsm-transitions']['mean'] - own['default']['mean']:.1f} us;"
                      " by call (means per step): "
                      + ", ".join(f"{name} {us:.1f} us" for name, us in split["fsm-transitions"].items())),
        _own_time_row("full audit", "fsm", runs, wrapper, own, on, status,
                      "the full audit (decision digests on, `consensus` off, the defaults). Paired: in FSMWorker's"
                      " process, each step's FSMWorker calls minus vLLM's worker calls inside them (super()), plus"
                      " its forward pre-hook; the mean over every step of the window (the journal's renders"
                      " in it), pooled over the processes; the median over steps, then over processes. Layer"
                      " difference between processes (FSMWorker's layer minus the default worker's, both worker"
                      f" call minus model-runner call; means): {own['fsm']['mean'] - own['default']['mean']:.1f} us;"
                      " by call (means per step): "
                      + ", ".join(f"{name} {us:.1f} us" for name, us in split["fsm"].items())),
    ]
    for row in rows:
        print("SUITE_ROW " + json.dumps(row), flush=True)
    print(json.dumps(summary, indent=1))
    if not same:
        raise SystemExit("outputs differ between workers or runs")


if __name__ == "__main__":
    main()
