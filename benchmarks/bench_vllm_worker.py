"""FSMWorker vs vLLM's default CPU worker on one workload: throughput ratio and the wrapper's
own time per step.

Same model (a random Llama made with transformers; `--arch` for Mixtral or Qwen3-MoE), same
requests (greedy, ignore_eos), same engine settings (float32, eager), same run of this script.
Each measurement is a fresh process (vLLM's CPU worker binds threads process-wide); workers
alternate (default, fsm, default, fsm, ...) so drift of a shared machine hits both, and the
ratio is of the medians. In each process, after a warm-up:
1. `LLM.generate` on the workload is timed (wall): the throughput;
2. timers are put around the worker's calls (`execute_model`, `sample_tokens`,
   `take_draft_token_ids`, `execute_dummy_batch`) and around the model runner's same calls,
   plus forward pre-hooks before and after the worker's own; the workload runs again and each
   step's layer time is (worker call - runner call) + (time in the forward pre-hook), thread
   CPU time. For vLLM's default worker that is its own thin layer (and the timers).
3. In FSMWorker's process, vLLM's worker calls that FSMWorker's methods make (super()) are
   timed too: each step's wrapper time is FSMWorker's calls minus those, plus its forward
   pre-hook. That is the wrapper's own time, paired step by step in one process; the
   difference of the two layers' medians, from different processes, is reported beside it
   (one process's median differs from the next one's by up to half on this machine).
FSMWorker runs twice per round: with the full audit and with `audit=transitions` (no
per-forward buffers records). Outputs of all runs must be equal. OMP_NUM_THREADS=1 for both (vLLM's CPU serving setting;
more threads than free cores make spin-waiting OpenMP times swing on a shared machine).

    .venv-vllm/bin/python benchmarks/bench_vllm_worker.py [--requests 32] [--max-new 32] [--repeats 2]
        [--runner v1|mrv2]

`--tp 2`: both workers at tensor_parallel_size 2 (vLLM's `mp` executor, one process per TP rank,
`VLLM_CPU_OMP_THREADS_BIND=0|1`): throughput only, with the full audit (the timers of step 2
and 3 live in one worker process).

`--runner mrv2`: vLLM's Model Runner V2 for both workers, as the MRV2 test leg runs it on this
CPU (VLLM_USE_V2_MODEL_RUNNER=1, Triton's interpreter for MRV2's kernels, the stand-in backend
of tests/mrv2_site): the interpreter slows vLLM's own step, not the wrapper's, so the ratio is
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
    execute_model with scheduled tokens."""
    import torch

    clock = time.thread_time_ns
    steps: list[int] = []
    wrapper_steps: list[int] = []
    by_call: dict[str, list[int]] = {}  # own time per call (and per forward pre-hook)
    # FSMWorker's own time per call, paired; its forward pre-hook is the wrapper's alone
    wrapper_by_call: dict[str, list[int]] = {"forward hook": by_call.setdefault("forward hook", [])}
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
                by_call.setdefault(name, []).append(own)
                if hook["ns"]:
                    by_call.setdefault("forward hook", []).append(hook["ns"])
                own += hook["ns"]
                # FSMWorker's own code: its call minus vLLM's worker call inside it (super()),
                # plus its forward pre-hook; 0 where FSMWorker does not override the call.
                wrapper = (total - inner["base"] if inner["base"] else 0) + hook["ns"]
                if inner["base"]:
                    wrapper_by_call.setdefault(name, []).append(total - inner["base"])
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
    return []


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
    kwargs = h.llm_kwargs(args.model_dir, worker=worker, run_dir=run_dir if worker else None,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                          max_model_len=512, kv_cache_memory_bytes=256 << 20, runner_fsm=options,
                          tensor_parallel_size=args.tp)
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
    steps = sum(1 for _ in own)
    Path(args.out).write_text(json.dumps({
        "worker": args.worker, "elapsed_s": elapsed, "cpu_s": cpu, "outputs": outputs, "again_equal": again == outputs,
        "output_tokens": sum(map(len, outputs.values())), "steps": steps,
        "own_us_median": statistics.median(own) / 1e3 if own else None,
        "own_us_p90": sorted(own)[int(0.9 * (len(own) - 1))] / 1e3 if own else None,
        "own_us_by_call_median": {name: statistics.median(ns) / 1e3 for name, ns in by_call.items() if ns},
        "wrapper_us_median": statistics.median(wrapper) / 1e3 if wrapper else None,
        "wrapper_us_p90": sorted(wrapper)[int(0.9 * (len(wrapper) - 1))] / 1e3 if wrapper else None,
        "wrapper_us_by_call_median": {name: statistics.median(ns) / 1e3 for name, ns in wrapper_by_call.items() if ns},
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
    if args.runner == "mrv2":
        env.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1")
        paths.append(str(REPO / "tests" / "mrv2_site"))
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
    """FSMWorker's own time per step over vLLM's own worker layer (issue 37's target: <= 1.0x).
    Each round pairs a default-worker process with the FSMWorker process after it (interleaved):
    the spread is over those rounds' ratios."""
    ratio = wrapper[worker] / own["default"]
    rounds = [f["wrapper_us_median"] / d["own_us_median"] for d, f in zip(runs["default"], runs[worker])]
    return dict(name=f"FSMWorker's own time per vLLM step / vLLM's worker layer, {level}{on}",
                figure=f"{wrapper[worker]:.1f} us (median, thread CPU, paired)",
                baseline=f"vLLM's worker layer {own['default']:.1f} us",
                ratio=f"{ratio:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]",
                target="<= 1.0x", status=status or ("pass" if ratio <= 1.0 else "miss"), note=note)


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
    p.add_argument("--runner", default="v1", choices=("v1", "mrv2"), help="vLLM's model runner for both workers")
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
                  f" {result['output_tokens']} tokens, {result['steps']} steps,"
                  f" layer time per step median {result['own_us_median']:.1f} us (p90 {result['own_us_p90']:.1f})"
                  + (f", wrapper's own {result['wrapper_us_median']:.1f} us (p90 {result['wrapper_us_p90']:.1f})"
                     if result["wrapper_us_median"] is not None else ""),
                  flush=True)
    reference = runs["default"][0]["outputs"]
    same = all(r["outputs"] == reference and r["again_equal"] for rs in runs.values() for r in rs)
    wall = {w: statistics.median(r["elapsed_s"] for r in rs) for w, rs in runs.items()}
    if args.tp > 1:
        return _tp_summary(args, runs, wall, same)
    cpu = {w: statistics.median(r["cpu_s"] for r in rs) for w, rs in runs.items()}
    own = {w: statistics.median(r["own_us_median"] for r in rs) for w, rs in runs.items()}
    # The wrapper's own time, paired: in FSMWorker's process, step by step, its calls minus
    # vLLM's worker calls inside them. The other figure, FSMWorker's layer minus the default
    # worker's, subtracts medians of different processes, which differ by up to half here.
    wrapper = {w: statistics.median(r["wrapper_us_median"] for r in runs[w]) for w in ("fsm", "fsm-transitions")}
    # Where the wrapper's time goes: per call, the median of the runs' paired medians.
    split = {worker: {name: statistics.median(r["wrapper_us_by_call_median"].get(name, 0.0) for r in runs[worker])
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
        "fsm_layer_us_per_step_median": own["fsm"], "default_layer_us_per_step_median": own["default"],
        "wrapper_own_us_per_step_median": wrapper["fsm"],
        "wrapper_own_us_per_step_median_audit_transitions": wrapper["fsm-transitions"],
        "layer_difference_us_per_step_median": own["fsm"] - own["default"],
        "layer_difference_us_per_step_median_audit_transitions": own["fsm-transitions"] - own["default"],
        "wrapper_own_us_by_call_median": split["fsm"],
        "wrapper_own_us_by_call_median_audit_transitions": split["fsm-transitions"],
        "throughput_ratio_audit_transitions": wall["default"] / wall["fsm-transitions"],
        "outputs_equal": same, "work_dir": str(work),
    }
    shape = f"random {args.arch}, hidden {args.hidden}, {args.layers} layers"
    on = "" if args.runner == "v1" else " (MRV2)"
    if args.runner == "mrv2":
        shape += "; Model Runner V2 under Triton's interpreter (vLLM's own step slowed, not the wrapper's)"
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
                      f" layer difference between processes {own['fsm-transitions'] - own['default']:.1f} us;"
                      " by call (medians): "
                      + ", ".join(f"{name} {us:.1f} us" for name, us in split["fsm-transitions"].items())),
        _own_time_row("full audit", "fsm", runs, wrapper, own, on, status,
                      "the full audit (decision digests on, `consensus` off, the defaults). Paired: in FSMWorker's"
                      " process, each step's FSMWorker calls minus vLLM's worker calls inside them (super()), plus"
                      " its forward pre-hook; median over steps, then over processes. Layer difference between"
                      " processes (FSMWorker's layer minus the default worker's, both worker call minus"
                      f" model-runner call): {own['fsm'] - own['default']:.1f} us; by call (medians): "
                      + ", ".join(f"{name} {us:.1f} us" for name, us in split["fsm"].items())),
    ]
    for row in rows:
        print("SUITE_ROW " + json.dumps(row), flush=True)
    print(json.dumps(summary, indent=1))
    if not same:
        raise SystemExit("outputs differ between workers or runs")


if __name__ == "__main__":
    main()
