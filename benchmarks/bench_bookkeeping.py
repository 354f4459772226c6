"""Bookkeeping cost per step: state machine transitions plus audit records.

Two figures, both with fakes for the forward and the collectives:
- `bookkeeping`: the triggers of one eager decode step (decode, finish) through `ReplicaMachine`
  with the 7 audit records such a step writes (2 transitions, the agreement's enqueue/done with
  what was sent and agreed, one buffers fingerprint, the forward's enqueue/done): what the
  state machine and the log add to a step (target <= 100 us, 1% of a 10 ms step);
- `whole step`: a full `RealStep` (8 decode rows) through the runner with the fake model in
  one process: validation, planning, agreement rule, buffer writes, forward, sampling, records
  (target <= 500 us). One process has no peers, so its collectives run inline (see
  `runner_fsm.agree.collectives`); with peers each collective adds a worker-thread hop.

Each figure is measured as wall time and as the process's CPU time: on a machine shared
with other jobs, wall time also counts the time this process waited for a core, while the
bookkeeping's cost to a step on its own core is its CPU time. The split of the bookkeeping
(machine alone, records alone) says where the time goes.

    .venv/bin/python benchmarks/bench_bookkeeping.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import anyio

from runner_fsm import dp
from runner_fsm.audit import AuditLog
from runner_fsm.agree.collectives import CollectiveRunner
from runner_fsm.config import RunnerConfig
from runner_fsm.events import Capture, RealStep
from runner_fsm.states.machine import Handler, ReplicaMachine
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.states import Trigger
from runner_fsm.dp import SingleReplicaAgreement
from runner_fsm.testing.fakes import expected_tokens
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch

STEP_BUDGET_US = 10_000.0
RECORDS_PER_DECODE_STEP = 7  # 2 transitions, agreement enqueue/done, buffers, forward enqueue/done
BOOKKEEPING_TARGET_US = 100.0
WHOLE_STEP_TARGET_US = 500.0


class _Clock:
    """Wall and process CPU time of a block, in microseconds per step."""

    def __init__(self, steps: int):
        self.steps = steps

    def __enter__(self) -> "_Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_exc) -> None:
        self.wall = (time.perf_counter() - self.wall) / self.steps * 1e6
        self.cpu = (time.process_time() - self.cpu) / self.steps * 1e6


async def _bookkeeping_us(steps: int, run_dir: str, *, machine: bool = True,
                          records: bool = True) -> _Clock:
    audit = AuditLog(run_dir, "bench", 0, 0, 0)
    buffers = PersistentBuffers(RunnerConfig(max_num_tokens=256))

    local = dp.LocalDispatch(0, dp.TARGET, dp.STATUS_OK, 8, dp.GRAPH_EAGER, 1, 8)
    agreed = dp.agree([local])

    def work(_event):
        audit.collective(0, "dp", "all_reduce", 1, [[7, 1]], 0, "enqueue", sent=dict(vars(local)))
        audit.collective(0, "dp", "all_reduce", 1, [[7, 1]], 0, "done", agreed=dict(vars(agreed)))
        audit.buffers(0, "real", buffers.fingerprint())
        audit.collective(0, "expert", "forward", 1, [[8]], 0, "enqueue", rows=8, dispatch_count=8, graph=False)
        audit.collective(0, "expert", "forward", 1, [[8]], 0, "done")

    def record(trig, src, dst, outcome):
        audit.transition(0, trig.value, src.value, dst.value, outcome)

    handlers = {Trigger.DECODE: Handler(after=work)} if records else {}
    fsm = ReplicaMachine(handlers, on_record=record if records else (lambda *a: None))
    await fsm.fire(Trigger.CAPTURE)
    await fsm.fire(Trigger.CAPTURED)
    before = audit.next_seq
    with _Clock(steps) as clock:
        for _ in range(steps):
            if machine:
                await fsm.fire(Trigger.DECODE)
                await fsm.fire(Trigger.FINISH)
            else:  # the same records without the machine
                work(None)
                record(Trigger.DECODE, fsm.state, fsm.state, "ok")
                record(Trigger.FINISH, fsm.state, fsm.state, "ok")
    if records:
        assert audit.next_seq - before == 7 * steps, "a step must write exactly 7 records here"
    assert fsm.state.value == "ready"
    audit.close()
    return clock


async def _whole_step_us(steps: int, run_dir: str) -> _Clock:
    cfg = RunnerConfig(max_num_tokens=1024)  # room for the 800-token prefill
    runner = make_runner(cfg, SingleReplicaAgreement(), run_dir=run_dir)
    await runner.handle(Capture())
    # The replica refuses decodes of requests it never prefilled: prefill them first. Then
    # each step decodes one more position of every request (new inputs every step, as in a
    # real run: a forward over the previous step's bytes is refused as a stale replay).
    await runner.handle(RealStep(prefill_batch([100] * 8)))
    batches = [decode_batch([100 + s] * 8, seed=s) for s in range(steps + 1)]
    out = await runner.handle(RealStep(batches[0]))
    assert out.sampled == expected_tokens(batches[0]), "the fake step must sample what the fake model says"
    before = runner.replica.audit.next_seq
    with _Clock(steps) as clock:
        for batch in batches[1:]:
            await runner.handle(RealStep(batch))
    records = (runner.replica.audit.next_seq - before) / steps
    assert records == RECORDS_PER_DECODE_STEP, f"a decode step writes {records} records"
    await runner.close()
    return clock


async def _collective_us(steps: int, _run_dir: str, *, peers: bool) -> _Clock:
    """One no-op collective call through `CollectiveRunner` (no log): the price of the
    worker-thread hop and watchdog that a group with peers pays, against an inline group."""
    runner = CollectiveRunner(None, 60.0, inline_groups=() if peers else ("dp",))
    with _Clock(steps) as clock:
        for step in range(steps):
            await runner.run("dp", "all_reduce", int, step_id=step)
    return clock


def measure(repeats: int = 7, steps: int = 300) -> dict[str, dict[str, list[float]]]:
    """Per figure, wall and CPU microseconds per step, one value per repeat (interleaved)."""
    kinds = {
        "bookkeeping": lambda d: _bookkeeping_us(steps, d),
        "machine only": lambda d: _bookkeeping_us(steps, d, records=False),
        "records only": lambda d: _bookkeeping_us(steps, d, machine=False),
        "whole step": lambda d: _whole_step_us(steps, d),
        "hop": lambda d: _collective_us(steps, d, peers=True),
        "inline": lambda d: _collective_us(steps, d, peers=False),
    }
    results = {name: {"wall": [], "cpu": []} for name in kinds}
    for _ in range(repeats):
        for name, fn in kinds.items():
            with tempfile.TemporaryDirectory() as run_dir:
                clock = anyio.run(fn, run_dir)
            results[name]["wall"].append(clock.wall)
            results[name]["cpu"].append(clock.cpu)
    return results


def rows(quick: bool = False):
    from common import Row, Spread, verdict

    res = measure(repeats=5 if quick else 7)
    med = {name: {k: statistics.median(v) for k, v in figs.items()} for name, figs in res.items()}
    book_cpu, book_wall = Spread.of(res["bookkeeping"]["cpu"]), Spread.of(res["bookkeeping"]["wall"])
    step_cpu, step_wall = Spread.of(res["whole step"]["cpu"]), Spread.of(res["whole step"]["wall"])
    budget = f"10 ms step ({STEP_BUDGET_US / 100:.0f} us = 1%)"
    return [
        Row("bookkeeping per step (CPU)", book_cpu.fmt(" us"), budget,
            f"{book_cpu.median / STEP_BUDGET_US:.2%}", f"<= {BOOKKEEPING_TARGET_US:.0f} us",
            verdict(book_cpu.median <= BOOKKEEPING_TARGET_US),
            note=(f"wall {book_wall.fmt(' us')} ({book_wall.median / STEP_BUDGET_US:.2%}); of the CPU time,"
                  f" transitions machine alone {med['machine only']['cpu']:.0f} us (2 triggers),"
                  f" the 7 audit records alone {med['records only']['cpu']:.0f} us")),
        Row("whole step with fakes (CPU)", step_cpu.fmt(" us"), "10 ms step",
            f"{step_cpu.median / STEP_BUDGET_US:.1%}", f"<= {WHOLE_STEP_TARGET_US:.0f} us",
            verdict(step_cpu.median <= WHOLE_STEP_TARGET_US),
            note=(f"wall {step_wall.fmt(' us')} ({step_wall.median / STEP_BUDGET_US:.1%}); one process,"
                  " 8 decode rows; wall exceeds CPU when other jobs share the cores")),
        Row("collective call, group with peers (CPU)", Spread.of(res["hop"]["cpu"]).fmt(" us"),
            f"inline group {Spread.of(res['inline']['cpu']).fmt(' us')}",
            f"{med['hop']['cpu'] / max(med['inline']['cpu'], 1e-9):.0f}x", "report", "report",
            note=(f"wall {Spread.of(res['hop']['wall']).fmt(' us')}; a no-op through the worker-thread"
                  " hop and watchdog, paid per collective when the group has peers")),
    ]


def main() -> int:
    for name, figs in measure(repeats=5 if "--quick" in sys.argv else 7).items():
        for kind, values in figs.items():
            med = statistics.median(values)
            print(f"{name:12s} {kind:4s} median {med:7.1f} us/step (min {min(values):.1f},"
                  f" max {max(values):.1f}) = {med / STEP_BUDGET_US:.2%} of a 10 ms step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
