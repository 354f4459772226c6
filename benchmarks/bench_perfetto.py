"""The Flight Recorder's cost per step, and the speed and memory of `replay --perfetto`.

- Flight Recorder: the same engine run (DP=2 x PCP=2, K=1 drafting, the tiny random model of
  `runner-fsm demo`: 8 requests x 16 new tokens) with the recorder on and off, alternated in one
  run of this script. A rank's time per step is its `elapsed_s` over its steps; a run's is its
  slowest rank's. Outputs must be equal and the dumps present only when on. Wall time per step
  on a shared machine moves by more than the recorder costs, so its cost is also measured
  where it is paid: the CPU time of one gloo collective with the recorder on and off (one
  process, nothing to wait for), times the collectives a step issues (counted from the dump).
- Export: a synthetic sound run of 8 ranks (DP=4 x PCP=2) x STEPS steps (`runner_fsm.testing.synth`,
  the records the runner writes) and one of STEPS / 10, each exported in a fresh process:
  records/s of the export pass (replay's own cost is the replay row), the trace's size, and
  the process's peak RSS, which must stay flat as the log grows tenfold.

    .venv/bin/python benchmarks/bench_perfetto.py            # 8 ranks x 100k steps
    .venv/bin/python benchmarks/bench_perfetto.py --quick    # 8 ranks x 10k steps
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Row, Spread

_EXPORT = r"""
import json, sys, time
from runner_fsm.replay.perfetto import export_perfetto
from runner_fsm.replay.report import ReplayReport, RunSummary

def peak_rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

run_dir, trace = sys.argv[1], sys.argv[2]
sound = ReplayReport(RunSummary(run_dir, 8, 4, 2, 0, None, None), ())  # the synthetic run is sound
start = time.perf_counter()
stats = export_perfetto(run_dir, trace, sound)
print(json.dumps({"seconds": time.perf_counter() - start, "records": stats.records, "events": stats.events,
                  "rss_mib": peak_rss_mib()}))
"""


def _export(steps: int, root: Path) -> dict:
    from runner_fsm.testing.synth import SynthSpec, write_run

    run_dir = root / f"steps-{steps}"
    write_run(run_dir, SynthSpec(dp_size=4, pcp_size=2, steps=steps))
    trace = run_dir / "trace.json"
    out = subprocess.run([sys.executable, "-c", _EXPORT, str(run_dir), str(trace)], capture_output=True,
                         text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    with open(trace, "rb") as f:  # a trace that does not parse is a wrong output
        f.seek(-4, os.SEEK_END)
        assert f.read().strip().endswith(b"]}"), "the trace file is not closed"
    result["trace_mib"] = trace.stat().st_size / 2**20
    for path in run_dir.iterdir():
        path.unlink()
    run_dir.rmdir()
    return result


def export_rows(steps: int) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-perfetto-") as root:
        small, big = _export(steps // 10, Path(root)), _export(steps, Path(root))
    rate = big["records"] / big["seconds"]
    growth = big["rss_mib"] / small["rss_mib"]
    return [Row(f"replay --perfetto export, 8 ranks x {steps // 1000}k steps",
                f"{rate:,.0f} rec/s ({big['records']:,} records in {big['seconds']:.0f} s), peak RSS"
                f" {big['rss_mib']:.1f} MiB",
                f"{steps // 10000}k steps: {small['records'] / small['seconds']:,.0f} rec/s, {small['rss_mib']:.1f} MiB",
                f"RSS {growth:.2f}x", "peak memory flat (<= 1.2x)", "pass" if growth <= 1.2 else "miss",
                note=f"{big['events']:,} trace events, {big['trace_mib']:,.0f} MiB of JSON; export pass only"
                     " (replay's verdicts are the replay row)")]


def _fr_run(root: Path, on: bool, rep: int) -> tuple[float, dict, bool, float]:
    from runner_fsm.process import flight_recorder
    from runner_fsm.config import ParallelLayout
    from runner_fsm.engine.api import run_engine
    from runner_fsm.engine.config import EngineConfig
    from runner_fsm.engine.requests import synthetic_requests

    run_dir = root / f"{'on' if on else 'off'}-{rep}"
    cfg = EngineConfig(model_dir=str(root / "model"), draft_dir=str(root / "draft"), run_dir=str(run_dir),
                       layout=ParallelLayout(2, 2), num_speculative_tokens=1)
    vocab = json.loads((root / "model" / "config.json").read_text())["vocab_size"]
    requests = synthetic_requests(8, vocab_size=vocab, seed=3, max_new_tokens=16, arrival_every=2)
    saved = os.environ.get(flight_recorder.DISABLE_ENV)
    os.environ[flight_recorder.DISABLE_ENV] = "1" if on else "0"
    try:
        result = run_engine(cfg, requests, timeout_s=300)
    finally:
        if saved is None:
            del os.environ[flight_recorder.DISABLE_ENV]
        else:
            os.environ[flight_recorder.DISABLE_ENV] = saved
    if not result.ok:
        raise RuntimeError(f"flight recorder {'on' if on else 'off'}: {result.errors}")
    per_step = max(r.elapsed_s / max(r.num_steps, 1) for r in result.ranks)
    dumped = len(list(run_dir.glob("fr-rank-*.json"))) == 4
    per_step_collectives = 0.0
    if dumped:  # every torch collective rank 0 issued, over its steps
        from runner_fsm.replay.flight import read_dump

        dump = read_dump(run_dir / "fr-rank-0.json", 0)
        per_step_collectives = sum(dump.enqueued.values()) / max(result.ranks[0].num_steps, 1)
    return per_step, result.outputs, dumped, per_step_collectives


def fr_rows(repeats: int) -> list[Row]:
    times: dict[bool, list[float]] = {True: [], False: []}
    per_step_collectives = 0.0
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    with tempfile.TemporaryDirectory(prefix="bench-fr-") as root:
        make_random_model(f"{root}/model", TARGET_SPEC, seed=0)
        make_random_model(f"{root}/draft", DRAFT_SPEC, seed=1)
        reference = None
        for rep in range(repeats):
            for on in ((False, True) if rep % 2 == 0 else (True, False)):
                per_step, outputs, dumped, collectives = _fr_run(Path(root), on, rep)
                per_step_collectives = max(per_step_collectives, collectives)
                if dumped != on:
                    raise RuntimeError(f"flight recorder {'on' if on else 'off'}: dumps present = {dumped}")
                if reference is not None and outputs != reference:
                    raise RuntimeError("outputs differ between Flight Recorder on and off")
                reference = outputs
                times[on].append(per_step)
    on, off = Spread.of(times[True]), Spread.of(times[False])
    ratio = on.median / off.median
    cpu_on, cpu_off = _collective_cpu(repeats)
    added = max(0.0, cpu_on.median - cpu_off.median) * per_step_collectives  # seconds per step
    share = added / off.median
    return [Row("Flight Recorder on vs off, wall per step (DP=2 x PCP=2, K=1, tiny model)", on.fmt(" ms", 1e3),
                f"off: {off.fmt(' ms', 1e3)}", f"{ratio:.3f}x", "report (wall time moves with the load)", "report",
                note=f"{repeats} runs each, alternated"),
            Row("Flight Recorder CPU per step = CPU per collective x collectives per step",
                f"+{added * 1e6:,.1f} us per step ({per_step_collectives:.0f} collectives x"
                f" {(cpu_on.median - cpu_off.median) * 1e6:+.2f} us)",
                f"per collective: on {cpu_on.fmt(' us', 1e6)}, off {cpu_off.fmt(' us', 1e6)}",
                f"{share:.2%} of a step", "<= 1% of a step", "pass" if share <= 0.01 else "miss",
                note="CPU time of gloo all_reduce calls in one process, recorder on and off, alternated;"
                     " collectives per step counted from the run's own dump")]


_COLLECTIVE_CPU = r"""
import os, sys, time
# Unset would not be off: torch 2.13 records gloo collectives by default (2000 entries).
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000" if sys.argv[1] == "1" else "0"
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
group = dist.new_group([0])
tensor = torch.zeros(7, 2, dtype=torch.int64)
for _ in range(500):
    dist.all_reduce(tensor, group=group)
best = float("inf")
for _ in range(5):
    start = time.process_time()
    for _ in range(4000):
        dist.all_reduce(tensor, group=group)
    best = min(best, (time.process_time() - start) / 4000)
dist.destroy_process_group()
print(best)
"""


def _collective_cpu(repeats: int) -> tuple[Spread, Spread]:
    """CPU seconds per gloo all_reduce with the recorder on and off (each the best of 5 x 4000)."""
    import socket

    out: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(repeats):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            done = subprocess.run([sys.executable, "-c", _COLLECTIVE_CPU, "1" if on else "0", str(port)],
                                  capture_output=True, text=True, check=True, env=env)
            out[on].append(float(done.stdout.strip().splitlines()[-1]))
    return Spread.of(out[True]), Spread.of(out[False])


def rows(quick: bool = False) -> list[Row]:
    return fr_rows(2 if quick else 3) + export_rows(10_000 if quick else 100_000)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from common import format_table

    print(format_table(rows(args.quick)))
