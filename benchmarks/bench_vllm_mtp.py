"""FSMWorker with MTP drafts under DP=2 x PCP=2 against DP=1 x PCP=2, on vLLM's Model Runner V2.

Model: the tiny MLA MoE with one MTP layer the tests use (`make_mtp_model`), float32, eager,
`speculative_config={"method": "mtp", "num_speculative_tokens": 1}`, greedy, the same requests
in both runs: split over the two replicas at DP=2 x PCP=2 (offline DP, one process per replica,
each with its two PCP workers: 4 workers), all on one replica at DP=1 x PCP=2 (2 workers). Under
DP x PCP FSMWorker's `draft_dp_sync` gives the draft its own DP agreement each step (vLLM 0.32
alone fails there, docs/vllm-mtp-pcp-dp.md), so the DP=2 figure includes that all-reduce.
In each run, after a warm-up: the requests are timed (tokens/s: every output token over the
slowest replica's `generate`); then bench_vllm_worker's timers go around the worker calls
(paired: FSMWorker's calls minus vLLM's worker calls inside them, plus its forward pre-hook) and
the requests run again: FSMWorker's own time per step with drafts, median over steps, then over
workers. Outputs must be equal across runs and replicas. MRV2 runs its kernels in Triton's
interpreter here (tests/vllm_site), which slows vLLM's step, not the wrapper's; on 2 cores four
workers share two, so the ratio says what DP x PCP costs this box, not a GPU.

    .venv-vllm/bin/python benchmarks/bench_vllm_mtp.py [--requests 8] [--max-new 16]

Prints one `SUITE_ROW {json}` line per row for benchmarks/run_all.py and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # vllm_harness: the vLLM test tier's engine settings
sys.path.insert(0, str(REPO))
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def timed_generate(llm, requests):
    """spmd's `Job.run`: warm-up, the timed requests, then the same under the worker timers."""
    from bench_vllm_worker import _install_timers

    import vllm_harness as h

    h.generate(llm, [h.Req("warm", requests[0].prompt[:8], 2)])
    outputs, seconds = h.generate(llm, requests)
    h.worker_call(llm, _install_timers)
    again, _ = h.generate(llm, requests)
    own = h.worker_call(llm, lambda w: list(w._bench_wrapper_steps))
    medians = [statistics.median(steps) / 1e3 for steps in own if steps]
    return outputs, seconds, {"again_equal": again == outputs, "wrapper_us_medians": medians,
                              "steps": max((len(s) for s in own), default=0)}


def _requests(num: int, max_new: int, seed: int) -> list[tuple]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(f"r{i}", tuple(int(t) for t in rng.integers(3, 512, int(rng.integers(16, 65)))), max_new)
            for i in range(num)]


def _run(model: str, dp: int, requests: list, work: Path) -> dict:
    import vllm_harness as h
    from runner_fsm.integrations.vllm.offline_dp import Job, launch_dp
    from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE

    kwargs = h.llm_kwargs(model, run_dir=str(work / f"run-dp{dp}"), block_size=MLA_BLOCK_SIZE,
                          max_num_batched_tokens=256, prefill_context_parallel_size=2, speculative_config=MTP)
    per_rank = [requests[r::dp] for r in range(dp)]
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(["0", "1"] * dp),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "vllm_site"), str(REPO), str(HERE)])}
    result = launch_dp([Job(kwargs, per_rank, run="bench_vllm_mtp:timed_generate")], dp_size=dp, cwd=str(work),
                       timeout_s=600, env=env)
    if any(code != 0 for code in result.codes):
        raise SystemExit(f"DP={dp} x PCP=2 failed ({result.codes}):\n{result.logs[0][-3000:]}")
    outputs = {rid: tokens for rank in result.outputs[0] for rid, tokens in rank.items()}
    extra = result.extra[0]
    return {"outputs": outputs, "seconds": max(result.job_s[0]), "again_equal": all(e["again_equal"] for e in extra),
            "wrapper_us": statistics.median(us for e in extra for us in e["wrapper_us_medians"]),
            "steps": max(e["steps"] for e in extra), "tokens": sum(map(len, outputs.values()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from runner_fsm.testing.vllm_models import make_mtp_model

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-mtp-"))
    model = make_mtp_model(work / "mtp_moe", moe=True, seed=3)
    requests = _requests(args.requests, args.max_new, args.seed)
    one, two = _run(model, 1, requests, work), _run(model, 2, requests, work)
    same = one["outputs"] == two["outputs"] and one["again_equal"] and two["again_equal"]
    rate = {dp: r["tokens"] / r["seconds"] for dp, r in ((1, one), (2, two))}
    shape = (f"tiny MLA MoE + 1 MTP layer (K=1), {args.requests} requests x {args.max_new} new tokens, greedy;"
             " MRV2 under Triton's interpreter; one run each, 4 workers on 2 cores at DP=2")
    status = None if same else "error"
    rows = [
        dict(name="FSMWorker MTP (K=1), DP=2 x PCP=2 vs DP=1 x PCP=2 (MRV2)",
             figure=f"DP=2 x PCP=2 {rate[2]:,.1f} tok/s", baseline=f"DP=1 x PCP=2 {rate[1]:,.1f} tok/s",
             ratio=f"{rate[2] / rate[1]:.2f}x", target="report", status=status or "report",
             note=f"{shape}; the draft's own DP agreement each step (draft_dp_sync); outputs "
                  + ("equal" if same else "DIFFER")),
        dict(name="FSMWorker's own time per vLLM step with MTP drafts, DP=2 x PCP=2 (MRV2)",
             figure=f"{two['wrapper_us']:.1f} us (median, thread CPU, paired)",
             baseline=f"DP=1 x PCP=2 {one['wrapper_us']:.1f} us", ratio=f"{two['wrapper_us'] / one['wrapper_us']:.2f}x",
             target="report", status=status or "report",
             note=("bench_vllm_worker's paired timers in every worker (median over steps, then over workers);"
                   " under PCP the forward hook logs the PCP manager's evidence; at DP=2 DP support's forward"
                   " pre-hook adds an expert-collective record and the watchdog's position in the job's store,"
                   " while the agreement rows ride inside vLLM's DP sync and count as vLLM's time")),
    ]
    for row in rows:
        print("SUITE_ROW " + json.dumps(row), flush=True)
    print(json.dumps({"dp1": {k: v for k, v in one.items() if k != "outputs"},
                      "dp2": {k: v for k, v in two.items() if k != "outputs"},
                      "tok_per_s": rate, "outputs_equal": same, "work_dir": str(work)}, indent=1))
    if not same:
        raise SystemExit("outputs differ between DP=1 and DP=2 or between runs")


if __name__ == "__main__":
    main()
