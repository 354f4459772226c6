"""Replay checker throughput and memory: records/s and peak memory at 1x and 10x log sizes.

Two sources of logs, each of STEPS and 10 x STEPS steps:
- `--source synth`: synthetic runs (`runner_fsm.testing.synth`, DP x PCP ranks, drafting, graph
  replays, `sent`/`agreed` on the DP agreements, expert-group forwards);
- `--source real`: the logs of a real DP x PCP run of the embedded engine (fake model, drafting,
  graph replays, all the evidence records), grown to the length by repeating its steps
  (`benchmarks/real_logs.py`): every record as the runner wrote it.
Each run is judged in a fresh process, so each peak is that size's own:
- `rss`: the process's peak resident set (VmHWM), interpreter included;
- `traced`: the peak of Python allocations during the replay (tracemalloc, a separate run,
  slower): what the checker itself holds. Streaming means it stays flat as the log grows.

    .venv/bin/python benchmarks/bench_replay.py                # 8 ranks x 10k and x 100k steps
    .venv/bin/python benchmarks/bench_replay.py --source real  # the same on a real run's logs
    .venv/bin/python benchmarks/bench_replay.py --steps 2000   # a quick look

Timings on a shared machine move with its load: the load average is printed with each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # real_logs, beside this file
from real_logs import tile_run, write_real_run  # noqa: E402

from runner_fsm.testing.synth import SynthSpec, write_run  # noqa: E402

# VmHWM, not getrusage: Linux carries ru_maxrss over fork and exec, so a child started by
# this process (torch loaded, for the synthetic buffers) would report this process's peak.
_MEASURE = r"""
import json, resource, sys, time, tracemalloc
from runner_fsm.replay.judge import replay

def peak_rss_mib():
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

run_dir, jobs, traced = sys.argv[1], None if sys.argv[2] == "auto" else int(sys.argv[2]), sys.argv[3] == "1"
last = int(sys.argv[4]) if len(sys.argv) > 4 else None  # replay --last N
if traced:
    tracemalloc.start()
start = time.perf_counter()
report = replay(run_dir, jobs=jobs, last=last)
seconds = time.perf_counter() - start
peak = tracemalloc.get_traced_memory()[1] if traced else None
print(json.dumps({"seconds": seconds, "records": report.summary.records, "sound": report.sound,
                  "first": report.summary.first_step, "last": report.summary.last_step,
                  "rss_mib": peak_rss_mib(),
                  "traced_mib": peak / 2**20 if traced else None}))
"""


def _measure(run_dir: Path, jobs: int | str, traced: bool, last: int | None = None) -> dict:
    """One replay in a fresh process (`last`: of the last N steps only; `jobs` "auto": as
    `runner-fsm replay` chooses with no `--jobs`)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(run_dir), str(jobs), "1" if traced else "0",
                          *([str(last)] if last else [])], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class _Writer:
    """Writes runs of a given length from one source (a real run is served once, then tiled)."""

    def __init__(self, source: str, base: Path, dp: int, pcp: int):
        self.source, self.dp, self.pcp = source, dp, pcp
        self._real = None
        if source == "real":
            self._real = base / "real-run"
            write_real_run(self._real, dp=dp, pcp=pcp)

    def write(self, run_dir: Path, steps: int) -> None:
        if self._real is not None:
            tile_run(self._real, run_dir, steps)
        else:
            write_run(run_dir, SynthSpec(dp_size=self.dp, pcp_size=self.pcp, steps=steps, spec_tokens=1))


def rows(quick: bool = False) -> list:
    """benchmarks/run_all.py's rows: records/s and peak RSS of one process at 1x and 10x,
    on synthetic logs and on a real run's logs."""
    from common import Row  # benchmarks/common.py, on the path when run_all imports this module

    steps = 500 if quick else 1000
    out = []
    for source in ("synth", "real"):
        measured = {}
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as base:
            writer = _Writer(source, Path(base), 4, 2)
            for factor in (1, 10):
                run_dir = Path(base) / f"{factor}x"
                writer.write(run_dir, steps * factor)
                measured[factor] = _measure(run_dir, 1, traced=False)
                assert measured[factor]["sound"], f"the {source} {factor}x run must replay sound"
                shutil.rmtree(run_dir)
        one, ten = measured[1], measured[10]
        growth = ten["rss_mib"] / one["rss_mib"]
        what = "synthetic" if source == "synth" else "a real run's"
        out.append(Row(f"runner-fsm replay, 10x log ({source})",
                       f"{ten['records'] / ten['seconds']:,.0f} rec/s, peak RSS {ten['rss_mib']:.1f} MiB"
                       f" ({ten['records']:,} records)",
                       f"1x log: {one['records'] / one['seconds']:,.0f} rec/s, {one['rss_mib']:.1f} MiB"
                       f" ({one['records']:,} records)",
                       f"RSS {growth:.2f}x", "peak memory flat (<= 1.2x)", "pass" if growth <= 1.2 else "miss",
                       note=f"8 ranks x {steps} and x {10 * steps} steps of {what} logs, one process"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--pcp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10_000, help="steps of the 1x run (10x is ten times)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2],
                        help="process counts to time (see runner-fsm replay --jobs); default 1 2")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: a temporary dir)")
    parser.add_argument("--source", choices=("synth", "real"), default="synth",
                        help="synthetic logs, or a real run's logs repeated to the length")
    parser.add_argument("--no-traced", action="store_true", help="skip the tracemalloc runs")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-replay-"))
    ranks = args.dp * args.pcp
    print(f"replay benchmark: {ranks} ranks ({args.dp} DP x {args.pcp} PCP), {args.source} logs, in {base};"
          f" load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        writer = _Writer(args.source, base, args.dp, args.pcp)
        for factor in (1, 10):
            steps = args.steps * factor
            run_dir = base / f"{factor}x"
            shutil.rmtree(run_dir, ignore_errors=True)
            start = time.perf_counter()
            writer.write(run_dir, steps)
            size = sum(p.stat().st_size for p in run_dir.glob("rank-*.jsonl"))
            written = time.perf_counter() - start
            traced = None if args.no_traced else _measure(run_dir, 1, traced=True)["traced_mib"]
            print(f"{factor:>3}x: {steps:>8} steps, {size / 2**20:8.1f} MiB written in {written:5.1f} s"
                  + (f"; peak traced (1 process) {traced:6.2f} MiB" if traced is not None else ""))
            for jobs in args.jobs:
                timed = _measure(run_dir, jobs, traced=False)
                assert timed["sound"], f"the {args.source} {factor}x run must be sound"
                print(f"      jobs={jobs}: {timed['records']:>10,} records in {timed['seconds']:6.2f} s,"
                      f" {timed['records'] / timed['seconds']:>9,.0f} records/s,"
                      f" peak rss {timed['rss_mib']:6.1f} MiB (this process)"
                      f" | load average {os.getloadavg()[0]:.1f}")
            shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
