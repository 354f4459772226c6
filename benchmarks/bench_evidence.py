"""What the evidence of issue 9 costs a step, measured in one run, on and off.

- `whole step`: the whole-step figure of `bench_bookkeeping` (a decode step of 8 rows with the
  fake model in one process), with the evidence the replica logs, and with that evidence
  stubbed out in this process (no content digests on the buffers record, no dispatch inputs,
  no output digest): the difference is what the evidence costs. Interleaved repeats.
- `records and bytes per step`: a real DP=2 x PCP=2 run of the embedded engine (tiny Mixtral,
  drafting, graph replays), counted per rank and step; the same run's records as main wrote
  them are counted by running this script against main's tree (see the closing note).

    .venv/bin/python benchmarks/bench_evidence.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).parent))
from bench_bookkeeping import _whole_step_us  # noqa: E402
from real_logs import per_step, write_real_run  # noqa: E402


@contextmanager
def evidence_off():
    """Stub the evidence out of the replica (this process only; a measurement, not a mode)."""
    from runner_fsm.replica import replica as replica_module
    from runner_fsm.pcp.buffers import PersistentBuffers

    saved = (replica_module.dispatch_inputs, replica_module.output_digest, PersistentBuffers.fingerprint)
    plain = PersistentBuffers.fingerprint
    replica_module.dispatch_inputs = lambda *a, **k: None
    replica_module.output_digest = lambda sampled: (0, 0)
    PersistentBuffers.fingerprint = lambda self, *, content=False: plain(self)
    try:
        yield
    finally:
        replica_module.dispatch_inputs, replica_module.output_digest, PersistentBuffers.fingerprint = saved


def measure(repeats: int = 7, steps: int = 300) -> dict[str, list[float]]:
    cpu = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in ("on", "off"):
            with tempfile.TemporaryDirectory() as run_dir:
                if mode == "off":
                    with evidence_off():
                        clock = anyio.run(_whole_step_us, steps, run_dir)
                else:
                    clock = anyio.run(_whole_step_us, steps, run_dir)
            cpu[mode].append(clock.cpu)
    return cpu


def records_per_step() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-evidence-") as base:
        run = Path(base) / "run"
        write_real_run(run, dp=2, pcp=2, requests=12)
        return per_step(run)


def rows(quick: bool = False) -> list:
    from common import Row, Spread

    cpu = measure(repeats=5 if quick else 7)
    on, off = Spread.of(cpu["on"]), Spread.of(cpu["off"])
    cost = on.median - off.median
    counted = records_per_step()
    return [Row("evidence per step (CPU)", f"{cost:.0f} us", f"whole step without it {off.fmt(' us')}",
                f"{cost / off.median:.1%}", "report", "report",
                note=f"whole step with it {on.fmt(' us')}; decode step of 8 rows, fake model, one process"),
            Row("audit records per rank and step", f"{counted['records_per_step']:.1f} records",
                f"{counted['bytes_per_step']:,.0f} bytes", "-", "report", "report",
                note="real DP=2 x PCP=2 run, tiny Mixtral, drafting, graph replays")]


def main() -> int:
    cpu = measure()
    for mode, values in cpu.items():
        print(f"whole step, evidence {mode:3s}: CPU median {statistics.median(values):7.1f} us/step"
              f" (min {min(values):.1f}, max {max(values):.1f})")
    print(f"evidence cost: {statistics.median(cpu['on']) - statistics.median(cpu['off']):.1f} us/step")
    print(records_per_step())
    return 0


if __name__ == "__main__":
    sys.exit(main())
