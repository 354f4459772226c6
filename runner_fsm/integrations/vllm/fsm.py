"""The replica state machine for a worker driven by vLLM: the runner's `SyncReplicaMachine`.

vLLM calls its worker synchronously, one call at a time, and the work of each step is vLLM's
own, so the worker drives the same synchronous machine the runner offers (the one table, the
same refusals, the same `fault` edge) with no handlers: each trigger becomes one `transition`
record of the audit log, exactly as the embedded runner writes them, under the step id the
worker gives.
"""

from __future__ import annotations

from runner_fsm.audit import AuditLog
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.machine import SyncReplicaMachine, TransitionRefused
from runner_fsm.states import State, Trigger


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self._step_id: int | None = None
        self._machine = SyncReplicaMachine({}, on_record=self._record)

    def _record(self, trigger: Trigger, src: State, dst: State, outcome: str) -> None:
        if self.audit is not None:
            self.audit.transition(self._step_id, trigger.value, src.value, dst.value, outcome)

    @property
    def state(self) -> str:
        return self._machine.state.value

    def fire(self, trigger: Trigger, step_id: int | None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised."""
        self._step_id = step_id
        try:
            self._machine.fire(trigger)
        except TransitionRefused:
            raise StepRefused(f"{trigger.value!r} is not allowed in state {self.state!r}") from None

    def is_(self, state: State) -> bool:
        return self._machine.state is state
