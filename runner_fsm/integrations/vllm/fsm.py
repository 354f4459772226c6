"""The replica state machine for a worker driven by vLLM: the runner's `TransitionCore`, logged.

vLLM calls its worker synchronously, one call at a time, and the work of each step is vLLM's
own, so the worker needs no event loop and no handlers: each trigger moves the one
`TransitionCore` (built from `runner_fsm.states.TRANSITIONS` on transitions' public API) and
becomes one `transition` record of the audit log, exactly as the embedded runner writes them.
"""

from __future__ import annotations

from runner_fsm.audit import AuditLog
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.machine import TransitionCore, TransitionRefused
from runner_fsm.states import State, Trigger


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self.core = TransitionCore()

    @property
    def state(self) -> str:
        return self.core.state.value

    def fire(self, trigger: Trigger, step_id: int | None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised."""
        src = self.core.state.value
        try:
            dst = self.core.move(trigger).value
        except TransitionRefused:
            if self.audit is not None:
                self.audit.transition(step_id, trigger.value, src, src, "refused")
            raise StepRefused(f"{trigger.value!r} is not allowed in state {src!r}") from None
        if self.audit is not None:
            self.audit.transition(step_id, trigger.value, src, dst, "ok")

    def is_(self, state: State) -> bool:
        return self.core.state is state
