"""The replica state machine for a worker driven by vLLM: synchronous, built from the one table.

vLLM calls its worker synchronously, one call at a time, so the worker needs no event loop.
A plain `transitions.Machine` is built from `runner_fsm.states.TRANSITIONS` (public API only:
no callbacks, nothing patched); its edges are read back from the machine once (`events`), each
trigger is checked against them and the machine is moved with `set_state`. Running its full
trigger path instead costs 9 us per trigger on an idle machine of this kind and 50 us under
load, two or three triggers a step, against a budget of 100 us for the whole wrapper; the
lookup and `set_state` cost a few. Every trigger becomes one `transition` record of the audit
log, exactly as the embedded runner writes them.
"""

from __future__ import annotations

from transitions import Machine

from runner_fsm.audit import AuditLog
from runner_fsm.integrations.vllm.errors import StepRefused
from runner_fsm.states import TRANSITIONS, State, Trigger


class _Model:
    state: str


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self._model = _Model()
        self._machine = Machine(
            model=self._model, states=[s.value for s in State], initial=State.INIT.value,
            transitions=[{"trigger": t.trigger.value, "source": [s.value for s in t.sources],
                          "dest": t.dest.value} for t in TRANSITIONS],
            auto_transitions=False, ignore_invalid_triggers=False,
        )
        self._edges = {(src, name): edges[0].dest for name, event in self._machine.events.items()
                       for src, edges in event.transitions.items()}

    @property
    def state(self) -> str:
        return self._model.state

    def fire(self, trigger: Trigger, step_id: int | None) -> None:
        """Move on `trigger`; a trigger the table forbids is logged `refused` and raised."""
        src = self._model.state
        dst = self._edges.get((src, trigger.value))
        if dst is None:
            if self.audit is not None:
                self.audit.transition(step_id, trigger.value, src, src, "refused")
            raise StepRefused(f"{trigger.value!r} is not allowed in state {src!r}")
        self._machine.set_state(dst, self._model)
        if self.audit is not None:
            self.audit.transition(step_id, trigger.value, src, dst, "ok")

    def is_(self, state: State) -> bool:
        return self._model.state == state.value
