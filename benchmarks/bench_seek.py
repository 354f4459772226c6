"""Replay that seeks (issue 34): the last 1,000 steps of a long run, judged without reading the
logs from their start, and the whole run judged with two processes.

The run is synthetic (`runner_fsm.testing.synth`, compact records as the runner writes them
now): 64 ranks (DP=8 x PCP=8), 100,000 steps, about 4 GiB. Writing 64 x 100k steps through
synth takes a quarter of an hour here, so each replica's PCP rank 0 is written by synth and its
PCP peers are copies of it with their own `job` record and buffer addresses (their records are
alike but for those: the synthetic PCP ranks of a replica log the same collectives).

Rows:
- `replay --last 1000`: wall time and peak RSS (a fresh process) at 10k and 100k steps, with
  the processes `runner-fsm replay` chooses when not told (`--jobs` left out: one per CPU for a
  run this size, 2 here; the RSS is the first process's, each child's is alike); the time
  barely grows with the log (a seek is a bisection: two more probes per tenfold), so the
  1M-step figure is extrapolated, not measured (a 1M-step run would be 40 GiB here);
- `replay --jobs 2`: the whole run (64 ranks x 10k steps) in records per second.

    .venv/bin/python benchmarks/bench_seek.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from runner_fsm.testing.synth import SynthSpec, write_run

DP, PCP = 8, 8
LAST = 1000
def write_big_run(run_dir: Path, steps: int) -> int:
    """DP x PCP ranks of `steps` steps (see the module docstring); the bytes written."""
    spec = SynthSpec(dp_size=DP, pcp_size=PCP, steps=steps, compact=True, seed=3)
    heads = run_dir.with_name(run_dir.name + "-heads")
    write_run(heads, SynthSpec(dp_size=DP, pcp_size=PCP, steps=0, compact=True, seed=3))
    write_run(run_dir, spec, ranks=[replica * PCP for replica in range(DP)])
    for rank in range(DP * PCP):
        if rank % PCP == 0:
            continue
        own = (heads / f"rank-{rank}.jsonl").read_bytes()
        source = (run_dir / f"rank-{rank - rank % PCP}.jsonl").read_bytes()
        body = source[source.index(b"\n") + 1:]
        body = body.replace(_p0(source), _p0(own))  # its own buffer addresses
        (run_dir / f"rank-{rank}.jsonl").write_bytes(own[:own.index(b"\n") + 1] + body)
    shutil.rmtree(heads)
    return sum(p.stat().st_size for p in run_dir.iterdir())


def _p0(log: bytes) -> bytes:
    return re.search(rb'"p0":\d+', log)[0]


def measure(run_dir: Path, jobs: int | str, last: int | None = None) -> dict:
    """A replay in a fresh process (its own peak memory): `bench_replay`'s measurement."""
    from bench_replay import _measure

    return _measure(run_dir, jobs, traced=False, last=last)


def default_jobs(run_dir: Path) -> int:
    """The processes `runner-fsm replay` starts for this run when `--jobs` is left out."""
    from runner_fsm.replay.discover import discover
    from runner_fsm.replay.judge import auto_jobs

    return auto_jobs(discover(run_dir))


def rows(quick: bool = False) -> list:
    from common import Row  # benchmarks/common.py, on the path when run_all imports this module

    long_steps, full_steps = (20_000, 2_000) if quick else (100_000, 10_000)
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-seek-") as base:
        last = {}
        for steps in (long_steps // 10, long_steps):
            run_dir = Path(base) / f"run-{steps}"
            size = write_big_run(run_dir, steps)
            last[steps] = dict(measure(run_dir, "auto", LAST), size=size, jobs=default_jobs(run_dir))
            got = last[steps]
            assert got["sound"] and (got["first"], got["last"]) == (steps - LAST, steps - 1), got
            shutil.rmtree(run_dir)
        short, long = last[long_steps // 10], last[long_steps]
        growth = long["rss_mib"] / short["rss_mib"]
        out.append(Row(f"replay --last {LAST}, {DP * PCP} ranks x {long_steps // 1000}k steps",
                       f"{long['seconds']:.2f} s, peak RSS {long['rss_mib']:.0f} MiB ({long['records']:,} records)",
                       f"{long_steps // 10 // 1000}k steps: {short['seconds']:.2f} s, {short['rss_mib']:.0f} MiB",
                       f"time {long['seconds'] / short['seconds']:.2f}x, RSS {growth:.2f}x",
                       "<= 5 s, flat memory", "pass" if long["seconds"] <= 5 and growth <= 1.2 else "miss",
                       note=(f"synthetic DP={DP} x PCP={PCP}, compact records, {long['size'] / 2**30:.1f} GiB;"
                             f" --jobs left out ({long['jobs']} processes, as runner-fsm replay chooses here; the"
                             " RSS is the first one's); 1M steps: not measured (40 GiB), extrapolated from the two sizes:"
                             f" about {long['seconds'] + (long['seconds'] - short['seconds']):.1f} s")))
        run_dir = Path(base) / "full"
        write_big_run(run_dir, full_steps)
        full = measure(run_dir, 2)
        assert full["sound"], full
        out.append(Row(f"replay --jobs 2, {DP * PCP} ranks x {full_steps // 1000}k steps (whole run)",
                       f"{full['records'] / full['seconds']:,.0f} rec/s", f"{full['records']:,} records in"
                       f" {full['seconds']:.1f} s", "-", "report", "report",
                       note=f"peak RSS {full['rss_mib']:.0f} MiB (the parent process)"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    start = time.perf_counter()
    for row in rows(args.quick):
        print(row)
    print(f"({time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
