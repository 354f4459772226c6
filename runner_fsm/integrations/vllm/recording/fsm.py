"""The replica state machine for a worker driven by vLLM: the runner's `TransitionCore`.

vLLM calls its worker synchronously, one call at a time, and the work of each step is vLLM's
own, so the worker needs no handlers: it moves the same core both drivers of `machine` move
(the one table, the same refusals, the same `fault` edge), and each trigger becomes one
`transition` record of the audit log, exactly as the embedded runner writes them, under the
step id the worker gives.

Two or three triggers fire per vLLM step, each right after vLLM's own work evicted the CPU
caches, where every call and object touched costs about a microsecond: `fire` is one lookup
in the core (`advance`) and one record whose bytes were rendered once per edge, where the
driver's `fire` went through six calls to the same record.
"""

from __future__ import annotations

from runner_fsm.audit import AuditLog
from runner_fsm.audit.log import AuditBatch
from runner_fsm.audit.compact import transition_body
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.machine import TransitionCore
from runner_fsm.states import State, Trigger


def _body(trigger: Trigger, src: State, dst: State, outcome: str) -> bytes:
    """A `transition` record's fields, rendered (what `AuditLog.transition` renders)."""
    return transition_body(trigger.value, src.value, dst.value, outcome)


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self._core = TransitionCore()
        self._bodies: dict[tuple[State, Trigger], bytes] = {}  # (src, trigger) -> the ok record

    @property
    def state(self) -> str:
        return self._core.state.value

    def fire(self, trigger: Trigger, step_id: int | None, batch: AuditBatch | None = None,
             decided: bytes | None = None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised.
        With `batch`, the record joins it (written when the batch is) instead of the log;
        `decided`: the step's decisions a `finish` carries, rendered (`compact.decisions_tail`)."""
        src, dst = self._core.advance(trigger)
        out = self.audit if batch is None else batch
        if dst is None:
            if out is not None:
                out.rendered("transition", step_id, _body(trigger, src, src, "refused"))
            raise StepRefused(f"{trigger.value!r} is not allowed in state {src.value!r}")
        if out is None:
            return
        body = self._bodies.get((src, trigger))
        if body is None:  # the edge's first time: a handful of edges, each rendered once
            body = self._bodies[(src, trigger)] = _body(trigger, src, dst, "ok")
        if decided is not None:
            out.rendered_transition(step_id, body, decided)
        else:
            out.rendered("transition", step_id, body)

    def is_(self, state: State) -> bool:
        return self._core.state is state
