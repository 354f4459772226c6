"""The Python calls and bytecodes FSMWorker makes per vLLM decode step: a count, not a time.

FSMWorker's own time per step (`bench_vllm_worker.py`) is measured right after vLLM's own work
evicted the CPU caches, where each Python call costs about a microsecond or two; on a shared
machine the median of the same code moves by half between processes, so a change of a tenth
does not show in a handful of runs. The number of calls and bytecodes a steady decode step runs
through the wrapper does not move: this script counts them with `sys.settrace` (opcode events),
over FSMWorker's own methods around a stand-in of vLLM's worker (no vLLM needed), at
`audit=transitions` (the transitions, the decision digest, the journal): 16 requests decoding,
eager, one replica. tests/test_step_calls.py holds the count to a budget.

The count is a mean over a whole number of the journal's batches (`journal.BATCH` steps, 32):
the journal renders its entries once a batch, and a window that leaves that step out flatters.

    .venv/bin/python benchmarks/step_calls.py [--steps 64]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from types import SimpleNamespace

import runner_fsm

from runner_fsm.audit import AuditLog
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.integrations.vllm import worker as worker_module
from runner_fsm.integrations.vllm.recording import forwards
from runner_fsm.integrations.vllm.recording.journal import BATCH as JOURNAL_BATCH, Journal
from runner_fsm.integrations.vllm.recording.probe import InputProbe
from runner_fsm.integrations.vllm.recording.recorder import ReplicaRecorder
from runner_fsm.integrations.vllm.recording.step_kinds import StepKinds

REQUESTS = 16
PACKAGE = os.path.dirname(runner_fsm.__file__) + os.sep
_MODE = SimpleNamespace(_name_="NONE")  # vLLM's CUDAGraphMode member: eager
_CONTEXT = SimpleNamespace(cudagraph_runtime_mode=_MODE, dp_metadata=None,
                           batch_descriptor=SimpleNamespace(num_tokens=REQUESTS, num_reqs=REQUESTS, uniform=True))


class _VLLMWorker:
    """What FSMWorker's super() calls reach: vLLM's worker, as far as a decode step goes (its
    forward runs the model's pre-hook, the one FSMWorker registers, inside vLLM's forward context)."""

    context = _CONTEXT  # the forward context its forwards run in (tests set others)

    def execute_model(self, scheduler_output):
        self.forward()

    def execute_dummy_batch(self):
        self.forward()

    def forward(self):
        forwards._VLLM_CONTEXT._forward_context = self.context
        try:
            self.hook(None, (), {})
        finally:
            forwards._VLLM_CONTEXT._forward_context = None

    def sample_tokens(self, grammar_output):
        return SimpleNamespace(sampled_token_ids=[[7 + i] for i in range(REQUESTS)])


class _Worker(worker_module.FSMWorkerMixin, _VLLMWorker):
    pass


def stand_in_worker(run_dir: str, captured: bool = True):
    """FSMWorker over the stand-in, set up as `init_device` and `load_model` leave it for one
    replica at `audit=transitions` (the attributes its step path reads), past graph capture
    (`captured=False`: in it)."""
    forwards._VLLM_CONTEXT = SimpleNamespace(_forward_context=None)
    worker = object.__new__(_Worker)
    audit = AuditLog(run_dir, "calls", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0))
    journal = Journal(run_dir, 0)
    audit.add_companion(journal)
    worker.recorder = ReplicaRecorder(audit, journal, fingerprints=False)
    worker.step_kinds, worker.probe, worker._dummy = StepKinds(), InputProbe(), False
    worker.dp_support = worker.replica_check = None
    worker.drafting, worker.draft_steps = False, 0
    worker.runner_adapter = SimpleNamespace(pcp=None)
    worker.place = SimpleNamespace(sizes=SimpleNamespace(pcp=1))
    worker.hook = worker.forward_hook()  # what load_model registers on the model
    worker.recorder.start_capture()
    if captured:
        worker.recorder.end_capture()
    return worker


def scheduler_output(step: int):
    """vLLM's SchedulerOutput for a decode step of the same `REQUESTS` requests."""
    ids = [f"req-{i}" for i in range(REQUESTS)]
    return SimpleNamespace(total_num_scheduled_tokens=REQUESTS, num_scheduled_tokens=dict.fromkeys(ids, 1),
                           scheduled_new_reqs=[], finished_req_ids=set(), scheduled_spec_decode_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=ids, resumed_req_ids=set(),
                                                                 num_computed_tokens=[64 + step] * REQUESTS))


def count(steps: int = 2 * JOURNAL_BATCH) -> dict:
    """{"calls": Python calls per step, "bytecodes": per step, "functions": {name: (calls, bytecodes)}}
    over `steps` decode steps after a warm-up, FSMWorker's code only (runner_fsm's modules), means.
    `steps` is a multiple of the journal's batch, so its renders count as often as they run."""
    if steps <= 0 or steps % JOURNAL_BATCH:
        raise ValueError(f"steps must be a positive multiple of the journal's batch ({JOURNAL_BATCH}), got {steps}")
    saved = forwards._VLLM_CONTEXT  # vLLM's forward context module, where it was imported: put back after
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            return _count(stand_in_worker(run_dir), steps)
    finally:
        forwards._VLLM_CONTEXT = saved


def _count(worker, steps: int) -> dict:
    """The count over `steps` steps of `worker`, after a warm-up."""
    for step in range(40):  # past the journal's first batch and every edge's first time
        worker.execute_model(scheduler_output(step))
        worker.sample_tokens(None)
    calls, ops = collections.Counter(), collections.Counter()

    def trace(frame, event, _arg):
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):  # the package's own code, not this stand-in's
            return None
        frame.f_trace_opcodes = True
        name = getattr(code, "co_qualname", code.co_name)
        (calls if event == "call" else ops)[name] += event in ("call", "opcode")
        return trace

    outputs = [scheduler_output(step) for step in range(40, 40 + steps)]  # made before tracing
    seq = worker.recorder.audit.next_seq
    sys.settrace(trace)
    try:
        for so in outputs:
            worker.execute_model(so)
            worker.sample_tokens(None)
    finally:
        sys.settrace(None)
    records = worker.recorder.audit.next_seq - seq
    worker.recorder.shutdown()
    return {"calls": sum(calls.values()) / steps, "bytecodes": sum(ops.values()) / steps,
            "records": records / steps,
            "functions": {name: (calls[name] / steps, ops[name] / steps) for name in sorted(calls, key=lambda n: -ops[n])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2 * JOURNAL_BATCH,
                        help=f"steps counted, a multiple of the journal's batch ({JOURNAL_BATCH})")
    result = count(parser.parse_args().steps)
    print(f"per decode step, mean: {result['calls']:.2f} Python calls, {result['bytecodes']:.0f} bytecodes,"
          f" {result['records']:.2f} records (Python {sys.version.split()[0]})")
    for name, (calls, ops) in result["functions"].items():
        print(f"  {name:45s} {calls:4.1f} calls {ops:6.1f} bytecodes")


if __name__ == "__main__":
    main()
