"""The GPU check (`make gpu-check`): the embedded engine with FULL_DECODE_ONLY device graphs.

On a CUDA machine (PyTorch only; the project's other dependencies as wheels, docs/gpu.md):
1. DP=1, tiny target model on cuda:0: an eager run and a graph run of the same requests;
   graphs captured, replayed after real batches, outputs equal to eager; the expert header
   check ran before every replay (outside the captured region); a replay whose buffers were
   not refreshed this step is refused (StaleBufferError); decode step time, graph vs eager.
2. DP=2 (NCCL, one GPU per replica: needs 2 GPUs): eager and graph runs where replica 1 idles
   while replica 0 decodes, so replica 1 replays a graph after a dummy; outputs equal to DP=1
   eager; then the same run with `skip-buffer-refresh` at the first such dummy step must fail
   with StaleBufferError on replica 1.
3. Where vLLM is installed, FSMWorker in vLLM's CUDA default (`gpu_check_vllm.py`; with `--cpu`,
   in the project's emulation of it).
Every check prints PASS or FAIL; exit 0 only when every check passed. `--cpu` runs the same
on the CPU (static graph back-end, gloo) so CI can run the script itself.

    python3 scripts/gpu_check.py [--cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    return bool(ok)


def workload():
    from runner_fsm.engine.requests import Request

    # Replica 0 decodes for many steps; replica 1's one short request ends early, so it
    # idles (dummy batches) while replica 0 still decodes in graph mode.
    return [Request("long", tuple(range(5, 29)), 24, 0, replica=0),
            Request("mid", tuple(range(40, 52)), 20, 0, replica=0),
            Request("short", tuple(range(70, 75)), 2, 0, replica=1)]


def config(model_dir: str, run_dir: Path, dp: int, graph: bool, device: str, injections=()):
    from runner_fsm.config import GraphMode, ParallelLayout
    from runner_fsm.engine.config import EngineConfig

    return EngineConfig(model_dir=model_dir, run_dir=str(run_dir), layout=ParallelLayout(dp, 1),
                        graph_mode=GraphMode.FULL_DECODE_ONLY if graph else GraphMode.NONE,
                        capture_sizes=(1, 2, 4), device=device, injections=tuple(injections),
                        collective_timeout_s=20.0, run_id=run_dir.name)


def records(run_dir: Path) -> list[dict]:
    from runner_fsm.audit import read_records

    out = []
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        out += list(read_records(path))  # in full, whatever the encoding on disk
    return out


def step_kinds(recs: list[dict], dp_rank: int) -> dict[int, str]:
    """step -> prefill | decode | idle_dummy, for one replica."""
    return {r["step_id"]: r["dst"] for r in recs if r["event"] == "transition" and r["dp_rank"] == dp_rank
            and r["dst"] in ("prefill", "decode", "idle_dummy")}


def replays(recs: list[dict], dp_rank: int) -> set[int]:
    return {r["step_id"] for r in recs if r["event"] == "graph" and r["action"] == "replay"
            and r["dp_rank"] == dp_rank}


def decode_step_ms(recs: list[dict]) -> list[float]:
    """Wall time of each decode step of replica 0 (first to last record of the step)."""
    kinds = step_kinds(recs, 0)
    span: dict[int, list[int]] = {}
    for r in recs:
        if r["dp_rank"] == 0 and kinds.get(r["step_id"]) == "decode":
            span.setdefault(r["step_id"], []).append(r["t_ns"])
    return [(max(t) - min(t)) / 1e6 for t in span.values()]


def _rank(groups, cfg, requests):
    """One rank of a DP job: its own GPU, then the engine's own rank entry."""
    import torch

    from runner_fsm.engine.worker import run_rank

    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(groups.global_rank)
    return run_rank(groups, cfg, requests)


def run(cfg, requests):
    """(outputs, rank errors) of one engine run."""
    from runner_fsm.engine.launch import spawn
    from runner_fsm.engine.worker import run_rank

    if cfg.layout.world_size == 1:
        ranks = [run_rank(None, cfg, requests)]
    else:
        ranks = spawn(_rank, cfg.layout, cfg, requests, timeout_s=300, pg_timeout_s=60)
    outputs = {}
    for r in ranks:
        if r.pcp_rank == 0:
            outputs.update(r.outputs)
    return outputs, {r.global_rank: r.error for r in ranks if r.error}


def dp1(model_dir: str, root: Path, device: str) -> dict:
    from runner_fsm.model.decoder import MixtralDecoder

    requests = [r for r in workload() if r.replica == 0]
    eager, errors = run(config(model_dir, root / "dp1-eager", 1, False, device), requests)
    check("DP=1 eager run", not errors, str(errors or ""))
    header_checks = []
    original = MixtralDecoder._check_graph_exchange

    def counted(self, step, step_id):
        header_checks.append(step_id)
        return original(self, step, step_id)

    MixtralDecoder._check_graph_exchange = counted
    try:
        graph, errors = run(config(model_dir, root / "dp1-graph", 1, True, device), requests)
    finally:
        MixtralDecoder._check_graph_exchange = original
    recs = records(root / "dp1-graph")
    captured = [r["num_tokens"] for r in recs if r["event"] == "graph" and r["action"] == "capture"]
    replayed = replays(recs, 0)
    kinds = step_kinds(recs, 0)
    check("DP=1 graph run", not errors, str(errors or ""))
    check("DP=1 graphs captured", captured == [1, 2, 4], f"sizes {captured}, backend "
          f"{sorted({r['backend'] for r in recs if r['event'] == 'graph' and 'backend' in r})}")  # captures name it
    check("DP=1 replays after real batches", len(replayed) >= 5 and all(kinds[s] == "decode" for s in replayed),
          f"{len(replayed)} replays, all on decode steps")
    check("DP=1 graph outputs equal eager", graph == eager and len(graph) == 2, f"{graph}")
    check("DP=1 header check before every replay", set(replayed) <= set(header_checks),
          f"{len(header_checks)} header checks for {len(replayed)} replays")
    check("DP=1 stale buffers refuse a replay", _stale_replay_refused(model_dir, root, device))
    timing = {"eager": decode_step_ms(records(root / "dp1-eager")), "graph": decode_step_ms(recs)}
    eager_ms, graph_ms = (statistics.median(timing[k]) for k in ("eager", "graph"))
    check("DP=1 decode step time measured", True,
          f"eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms (median of {len(timing['graph'])} steps):"
          f" {eager_ms / graph_ms:.2f}x")
    return eager


def _stale_replay_refused(model_dir: str, root: Path, device: str) -> bool:
    """Capture, then replay without writing the buffers this step: the replay must be refused."""
    import anyio

    from runner_fsm.engine.worker import build_runner
    from runner_fsm.errors import StaleBufferError
    from runner_fsm.events import Capture

    runner = build_runner(config(model_dir, root / "dp1-stale", 1, True, device), None)
    try:
        anyio.run(runner.handle, Capture())
        graphs = runner.replica.graphs
        since = graphs.buffers.fingerprint()  # the step starts; nothing is written
        try:
            graphs.replay(2, step_id=0, since=since)
        except StaleBufferError as exc:
            return "not refreshed" in str(exc)
        return False
    finally:
        anyio.run(runner.close)


def dp2(model_dir: str, root: Path, device: str, reference: dict) -> None:
    requests = workload()
    eager, errors = run(config(model_dir, root / "dp2-eager", 2, False, device), requests)
    check("DP=2 eager run", not errors, str(errors or ""))
    graph, errors = run(config(model_dir, root / "dp2-graph", 2, True, device), requests)
    check("DP=2 graph run", not errors, str(errors or ""))
    recs = records(root / "dp2-graph")
    kinds = step_kinds(recs, 1)
    after_dummy = sorted(s for s in replays(recs, 1) if kinds.get(s) == "idle_dummy")
    check("DP=2 replica 1 replays after a dummy", len(after_dummy) >= 3, f"dummy replays at steps {after_dummy}")
    same = {k: v for k, v in reference.items()}
    check("DP=2 outputs equal eager (DP=2 and DP=1)", graph == eager and all(graph.get(k) == v for k, v in same.items()),
          f"{graph}")
    if not after_dummy:
        check("DP=2 stale buffers refuse a replay", False, "no dummy replay step to inject at")
        return
    step = after_dummy[0]
    _, errors = run(config(model_dir, root / "dp2-stale", 2, True, device,
                           [f"skip-buffer-refresh@replica=1,step={step}"]), requests)
    culprit = errors.get(1, {})
    check("DP=2 stale buffers refuse a replay", culprit.get("type") == "StaleBufferError"
          and "graph replay refused" in culprit.get("message", ""), f"replica 1 at step {step}: {culprit}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry mode: CPU, static graphs, gloo")
    parser.add_argument("--out", help="keep the runs' audit logs here")
    args = parser.parse_args()
    start = time.monotonic()
    import torch

    from runner_fsm.model import TARGET_SPEC, make_random_model

    device = "cpu" if args.cpu else "cuda"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, {gpus} CUDA device(s), mode {device}", flush=True)
    if device == "cuda" and not check("a CUDA device", gpus >= 1, f"{gpus} found"):
        return 1
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model_dir = str(root / "model")
        make_random_model(model_dir, TARGET_SPEC, seed=0)
        reference = dp1(model_dir, root, device)
        if device == "cpu" or check("two CUDA devices for DP=2 over NCCL", gpus >= 2, f"{gpus} found"):
            dp2(model_dir, root, device, reference)
        if importlib.util.find_spec("vllm") is None:  # not a failure: the engine's checks need no vLLM
            print("NOT RUN  vLLM path: vLLM is not installed here (scripts/gpu_check_vllm.py)", flush=True)
        else:  # FSMWorker in vLLM's CUDA default; with --cpu, in the project's emulation of it
            from gpu_check_vllm import vllm_path

            vllm_path(device == "cpu", str(root / "vllm"), check)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {time.monotonic() - start:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
