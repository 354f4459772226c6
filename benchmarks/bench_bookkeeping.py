"""Bookkeeping cost per step: state machine transitions plus audit records.

Two figures, both with fakes for the forward and the collectives:
- `bookkeeping`: the triggers of one decode step (decode, finish) through `ReplicaMachine`
  with the audit records a real step writes (2 transitions, an agreement's enqueue/done,
  one buffers fingerprint): what the state machine and the log add to a step;
- `whole step`: a full `RealStep` through the runner with the fake model: validation,
  planning, agreement rule, buffer writes, two worker-thread hops, sampling, records.
Both are reported in microseconds and as a share of a 10 ms step (target: <= 1%, 100 us).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import anyio

from runner_fsm.audit import AuditLog
from runner_fsm.config import RunnerConfig
from runner_fsm.events import Capture, RealStep
from runner_fsm.machine import Handler, ReplicaMachine
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.states import Trigger
from runner_fsm.testing.fakes import LocalAgreement
from runner_fsm.testing.harness import decode_batch, make_runner

STEP_BUDGET_US = 10_000.0


async def _bookkeeping_us(steps: int, run_dir: str) -> float:
    audit = AuditLog(run_dir, "bench", 0, 0, 0)
    buffers = PersistentBuffers(RunnerConfig(max_num_tokens=256))

    def work(_event):
        audit.collective(0, "dp", "all_reduce", 1, [[7, 1]], 0, "enqueue")
        audit.collective(0, "dp", "all_reduce", 1, [[7, 1]], 0, "done")
        audit.buffers(0, "real", buffers.fingerprint())

    record = lambda trig, src, dst, outcome: audit.transition(0, trig.value, src.value, dst.value, outcome)
    machine = ReplicaMachine({Trigger.DECODE: Handler(after=work)}, on_record=record)
    await machine.fire(Trigger.CAPTURE)
    await machine.fire(Trigger.CAPTURED)
    start = time.perf_counter()
    for _ in range(steps):
        await machine.fire(Trigger.DECODE)
        await machine.fire(Trigger.FINISH)
    elapsed = time.perf_counter() - start
    audit.close()
    return elapsed / steps * 1e6


async def _whole_step_us(steps: int, run_dir: str) -> float:
    cfg = RunnerConfig(max_num_tokens=256)
    runner = make_runner(cfg, LocalAgreement(), run_dir=run_dir)
    await runner.handle(Capture())
    batch = decode_batch([100] * 8)
    start = time.perf_counter()
    for _ in range(steps):
        await runner.handle(RealStep(batch))
    elapsed = time.perf_counter() - start
    await runner.close()
    return elapsed / steps * 1e6


def measure(repeats: int = 7, steps: int = 300) -> dict[str, list[float]]:
    results = {"bookkeeping": [], "whole step": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
            results["bookkeeping"].append(anyio.run(_bookkeeping_us, steps, d1))
            results["whole step"].append(anyio.run(_whole_step_us, steps, d2))
    return results


def main() -> None:
    for name, values in measure().items():
        med = statistics.median(values)
        print(f"{name:12s} median {med:7.1f} us/step (min {min(values):.1f}, max {max(values):.1f})"
              f" = {med / STEP_BUDGET_US:.2%} of a 10 ms step")


if __name__ == "__main__":
    main()
