"""The replica state machine for a worker driven by vLLM: synchronous, built from the one table.

vLLM calls its worker synchronously, one call at a time, so the worker needs no event loop:
a plain `transitions.Machine` over `runner_fsm.states.TRANSITIONS` (public API only, no
callbacks) moves the state, and every trigger becomes one `transition` record of the audit
log, exactly as the embedded runner writes them. One trigger costs about 9 us on this machine.
"""

from __future__ import annotations

from transitions import Machine, MachineError

from runner_fsm.audit import AuditLog
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.states import TRANSITIONS, State, Trigger


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self.state = State.INIT.value  # kept by transitions (model_attribute "state")
        self._machine = Machine(
            model=self, states=[s.value for s in State], initial=State.INIT.value,
            transitions=[{"trigger": t.trigger.value, "source": [s.value for s in t.sources],
                          "dest": t.dest.value} for t in TRANSITIONS],
            auto_transitions=False, ignore_invalid_triggers=False,
        )

    def fire(self, trigger: Trigger, step_id: int | None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised."""
        src = self.state
        try:
            self.trigger(trigger.value)  # the model method transitions adds
        except MachineError:
            if self.audit is not None:
                self.audit.transition(step_id, trigger.value, src, src, "refused")
            raise StepRefused(f"{trigger.value!r} is not allowed in state {src!r}") from None
        if self.audit is not None:
            self.audit.transition(step_id, trigger.value, src, self.state, "ok")

    def is_(self, state: State) -> bool:
        return self.state == state.value
