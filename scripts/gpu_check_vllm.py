"""The GPU check's vLLM path: FSMWorker in vLLM's CUDA default, where vLLM is installed.

A tiny random Llama served by vLLM's default worker, then by FSMWorker, each with Model Runner
V2, the JIT warm-up, FULL_DECODE_ONLY graphs and async scheduling (vLLM's defaults on CUDA, with
graphs limited to sizes 1-8 and no torch.compile, to keep the check short). Checks: equal tokens;
at least half the decode steps replay a graph, each after a `buffers` record of its step; the
warm-up recorded under `capturing`; replay sound. `--emulate` runs the same on this CPU in the
project's emulation of that configuration (RUNNER_FSM_EMULATE_DEVICE=1, MRV2 under Triton's
interpreter): the dry run that CI can do. Each run is a child process (vLLM picks its platform
once per process).

    python scripts/gpu_check_vllm.py [--emulate] [--out DIR]      (prints PASS/FAIL lines; exit 0: all passed)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = [(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(4 + 3 * i)], 12) for i in range(6)]
FSM = "runner_fsm.integrations.vllm.FSMWorker"


def child(model_dir: str, run_dir: str | None) -> None:
    """One `LLM`, the workload, its tokens printed as `TOKENS {...}` (this process only)."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model_dir, dtype="float32", seed=0, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=False,
                  compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8]})
    if run_dir is not None:
        kwargs.update(worker_cls=FSM, additional_config={"runner_fsm": {"run_dir": run_dir}})
    llm = LLM(**kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in WORKLOAD],
                        SamplingParams(temperature=0.0, max_tokens=WORKLOAD[0][2], ignore_eos=True), use_tqdm=False)
    print("TOKENS " + json.dumps({rid: list(o.outputs[0].token_ids) for (rid, _, _), o in zip(WORKLOAD, outs)}))


def run(model_dir: str, run_dir: str | None, env: dict) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, "--child", model_dir, run_dir or ""], env=env,
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TOKENS ")), None)
    if proc.returncode or line is None:
        print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
        return None
    return json.loads(line[7:])


def vllm_path(emulate: bool, out: str | None, check) -> None:
    """The checks above, each reported by `check(name, ok, detail)` (the GPU check's)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="1")
    if emulate:
        env.update(RUNNER_FSM_EMULATE_DEVICE="1", TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "vllm_site"), str(REPO), env.get("PYTHONPATH", "")])
    from runner_fsm.audit import read_records
    from runner_fsm.replay.judge import replay
    from runner_fsm.testing.vllm_models import make_model

    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        root = Path(out or tmp)
        model_dir = make_model(root / "llama", "llama", seed=0)
        run_dir = root / "fsm"
        default, ours = run(model_dir, None, env), run(model_dir, str(run_dir), env)
        if check("vLLM path: both workers ran", default is not None and ours is not None):
            check("vLLM path: FSMWorker's tokens equal the default worker's", ours == default)
            recs = list(read_records(run_dir / "rank-0.jsonl"))
            decode = [r["step_id"] for r in recs if r["event"] == "transition" and r["trigger"] == "decode"]
            buffers = {r["step_id"] for r in recs if r["event"] == "buffers" and r["reason"] == "replay"}
            replayed = [r["step_id"] for r in recs if r["event"] == "graph" and r["action"] == "replay"]
            warmups = [r for r in recs if r["event"] == "graph" and r["action"] == "warmup"]
            check("vLLM path: half the decode steps or more replay a graph, each after its buffers record",
                  decode and 2 * len(replayed) >= len(decode) and set(replayed) <= buffers,
                  f"{len(replayed)} replays, {len(decode)} decode steps")
            check("vLLM path: the JIT warm-up recorded under capturing", bool(warmups) and
                  all(r["step_id"] == -1 for r in warmups), f"{len(warmups)} warm-up steps")
            report = replay(run_dir)
            check("vLLM path: replay sound", report.sound, report.format().splitlines()[-1])


def main() -> int:
    failed = []

    def check(name: str, ok: bool, detail: str = "") -> bool:  # the GPU check's PASS/FAIL line
        print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
        if not ok:
            failed.append(name)
        return bool(ok)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulate", action="store_true", help="the CPU dry run, in the project's emulation")
    parser.add_argument("--out", help="keep the model and the audit log here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1] or None)
        return 0
    vllm_path(args.emulate, args.out, check)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
