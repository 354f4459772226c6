"""Throughput of one workload through vLLM with FSMWorker vs vLLM's default CPU worker.

Same model (a tiny random Mixtral from `runner-fsm make-model`, or --model-dir), same requests,
same engine settings (float32, eager, greedy, ignore_eos), same run of this script. Each
measurement is a fresh process (vLLM's CPU worker rebinds threads and patches
`torch.set_num_threads` process-wide), which first warms up on a small batch, then times
`LLM.generate` on the workload. Workers alternate (default, fsm, default, fsm, ...) so drift
of a shared machine hits both; the ratio is of the medians. Wall time is what a user sees; the
process's CPU time (all threads) is steadier on a shared machine and also counts busy-waiting
OpenMP threads. Outputs are checked for equality. Both workers get OMP_NUM_THREADS=1 by default
(vLLM's own serving setting): with more threads than free cores, vLLM's CPU worker's bound,
spin-waiting OpenMP threads make its times swing several-fold on a shared machine.

    .venv-vllm/bin/python benchmarks/bench_vllm_worker.py [--requests 32] [--max-new 32] [--repeats 2]
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


def _workload(vocab: int, num: int, max_new: int, seed: int):
    import numpy as np

    from runner_fsm.engine.requests import Request

    rng = np.random.default_rng(seed)
    return [Request(f"r{i}", tuple(int(t) for t in rng.integers(3, vocab, int(rng.integers(16, 129)))), max_new)
            for i in range(num)]


def _child(args) -> None:
    """One measurement: this process's own vLLM engine core with one worker class."""
    from runner_fsm.integrations.vllm import harness as h

    worker = None if args.worker == "default" else FSM
    requests = _workload(args.vocab, args.requests, args.max_new, args.seed)
    warmup = _workload(args.vocab, 4, 4, args.seed + 1)
    run_dir = str(Path(args.out).with_suffix("")) + "-run"
    options = {"graph_mode": "full_decode_only"} if args.fsm_graphs else {}
    kwargs = h.llm_kwargs(args.model_dir, worker=worker, run_dir=run_dir if worker else None,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                          max_model_len=512, kv_cache_memory_bytes=256 << 20, runner_fsm=options)
    with h.open_llm(**kwargs) as llm:
        h.generate(llm, warmup)
        cpu = time.process_time()
        outputs, elapsed = h.generate(llm, requests)
        cpu = time.process_time() - cpu
    import torch

    Path(args.out).write_text(json.dumps({
        "worker": args.worker, "elapsed_s": elapsed, "cpu_s": cpu, "outputs": outputs, "torch_threads": torch.get_num_threads(),
        "prompt_tokens": sum(len(r.prompt) for r in requests), "output_tokens": sum(map(len, outputs.values())),
    }))


def _measure(args, worker: str, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", worker, "--out", str(out), "--model-dir", args.model_dir,
           "--requests", str(args.requests), "--max-new", str(args.max_new), "--seed", str(args.seed),
           "--vocab", str(args.vocab), "--budget", str(args.budget), "--max-num-seqs", str(args.max_num_seqs)]
    if args.fsm_graphs:
        cmd.append("--fsm-graphs")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        code = subprocess.call(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{worker} run failed ({code}); see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a Mixtral checkpoint directory (default: a tiny random one)")
    p.add_argument("--hidden", type=int, help="shape of the random model (default: make-model's)")
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="measurements per worker (alternating)")
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS for both workers (default 1, as vLLM serves; 0: leave it unset)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--fsm-graphs", action="store_true",
                   help="FSMWorker with graph_mode=full_decode_only (the runner's CPU static replay)")
    p.add_argument("--child", choices=("default", "fsm"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.worker = args.child
        _child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if args.model_dir is None:
        from runner_fsm.model import TARGET_SPEC, make_random_model
        from runner_fsm.model.make import with_overrides

        spec = with_overrides(TARGET_SPEC, hidden=args.hidden, layers=args.layers, experts=args.experts,
                              intermediate=2 * args.hidden if args.hidden else None)
        args.model_dir = str(work / "model")
        make_random_model(args.model_dir, spec, seed=0)
        print(f"model: {spec}", flush=True)
    runs: dict[str, list[dict]] = {"default": [], "fsm": []}
    for i in range(args.repeats):
        for worker in ("default", "fsm"):
            result = _measure(args, worker, work / f"{worker}-{i}.json")
            runs[worker].append(result)
            print(f"{worker:8s} run {i}: {result['elapsed_s']:.3f} s wall, {result['cpu_s']:.3f} s cpu,"
                  f" {result['output_tokens']} output tokens,"
                  f" torch threads {result['torch_threads']}", flush=True)
    same = all(r["outputs"] == runs["default"][0]["outputs"] for rs in runs.values() for r in rs)
    median = {w: statistics.median(r["elapsed_s"] for r in rs) for w, rs in runs.items()}
    cpu = {w: statistics.median(r["cpu_s"] for r in rs) for w, rs in runs.items()}
    tokens = runs["fsm"][0]["output_tokens"]
    summary = {
        "model_dir": args.model_dir, "omp_num_threads": args.threads, "fsm_graphs": args.fsm_graphs, "requests": args.requests, "max_new_tokens": args.max_new,
        "prompt_tokens": runs["fsm"][0]["prompt_tokens"], "output_tokens": tokens,
        "default_s": median["default"], "fsm_s": median["fsm"],
        "default_tok_per_s": tokens / median["default"], "fsm_tok_per_s": tokens / median["fsm"],
        "throughput_ratio_fsm_over_default": median["default"] / median["fsm"],
        "default_cpu_s": cpu["default"], "fsm_cpu_s": cpu["fsm"],
        "cpu_ratio_default_over_fsm": cpu["default"] / cpu["fsm"],
        "outputs_equal": same, "work_dir": str(work),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
