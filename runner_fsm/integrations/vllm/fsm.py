"""The replica state machine for a worker driven by vLLM: the runner's `SyncReplicaMachine`.

vLLM calls its worker synchronously, one call at a time, and the work of each step is vLLM's
own, so the worker drives the same synchronous machine the runner offers (the one table, the
same refusals, the same `fault` edge) with no handlers: each trigger becomes one `transition`
record of the audit log, exactly as the embedded runner writes them, under the step id the
worker gives.
"""

from __future__ import annotations

from runner_fsm.audit import AuditLog
from runner_fsm.audit.log import AuditBatch
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.machine import SyncReplicaMachine, TransitionRefused
from runner_fsm.states import State, Trigger


# Plain names: an enum's `.value` is a Python-level property call, six of them a step.
_NAMES = {member: member.value for member in (*State, *Trigger)}


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self._step_id: int | None = None
        self._out: AuditLog | AuditBatch | None = audit  # where this trigger's records go
        self._machine = SyncReplicaMachine({}, on_record=self._record)

    def _record(self, trigger: Trigger, src: State, dst: State, outcome: str) -> None:
        if self._out is not None:
            self._out.transition(self._step_id, _NAMES[trigger], _NAMES[src], _NAMES[dst], outcome)

    @property
    def state(self) -> str:
        return self._machine.state.value

    def fire(self, trigger: Trigger, step_id: int | None, batch: AuditBatch | None = None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised.
        With `batch`, the records join it (written when the batch is) instead of the log."""
        self._step_id = step_id
        if batch is not None:
            self._out = batch
        try:
            self._machine.fire(trigger)
        except TransitionRefused:
            raise StepRefused(f"{trigger.value!r} is not allowed in state {self.state!r}") from None
        finally:
            self._out = self.audit

    def is_(self, state: State) -> bool:
        return self._machine.state is state
