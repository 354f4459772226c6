"""The replica state machine: a synchronous `transitions.Machine` built from the table, with
the step work run around it.

`TransitionCore` is the bookkeeping alone: the states and edges of
`runner_fsm.states.TRANSITIONS` in a plain `transitions.Machine` (public API only: no
callbacks, no queue, nothing patched). It answers "where does this trigger go from here" and
moves the state; it never runs work, so it costs a few microseconds and can be used from
synchronous code.

Work is attached per trigger as `Handler(before, after)`: `before` runs in the source state
(validation, so a bad batch leaves everything untouched), `after` runs in the destination
state (the step's work). `ReplicaMachine` drives them (async, the embedded runner): a handler
may return an awaitable, which is awaited in the calling task, so callbacks run one after
another and a collective is never raced; nothing here cancels a running transition. (vLLM's
worker drives the same core without handlers: `integrations/vllm/recording/step_machine.py`,
since there each step's work is vLLM's own.)

Rules: a trigger the table does not allow from the current state is refused
(`TransitionRefused`, logged `refused`, nothing runs); any error takes the table's `fault`
edge with the cause kept and logged; a `CancelledError` is logged `cancelled` and propagates
(a cancelled or timed-out trigger is neither success nor a fault of this replica).
One trigger runs at a time: a trigger fired while another is running is an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Mapping, Optional

import transitions

from runner_fsm.errors import RunnerError
from runner_fsm.states import TRANSITIONS, State, Trigger

Callback = Callable[[Any], Optional[Awaitable[None]]]
Recorder = Callable[[Trigger, State, State, str], None]
_STATES = {s.value: s for s in State}
_VALUES = {s: s.value for s in State}  # an enum's `.value` is a Python-level property call
_ENDED = (State.FAULTED, State.STOPPED)


class TransitionRefused(RunnerError):
    """A trigger that the transition table does not allow from the current state."""


@dataclasses.dataclass(frozen=True)
class Handler:
    """Work bound to one trigger: `before` in the source state, `after` in the destination."""

    before: Callback | None = None
    after: Callback | None = None


class _Model:
    """The object whose `state` attribute `transitions` keeps (its trigger methods live here)."""

    state: str


class TransitionCore:
    """The replica's states and edges as a synchronous `transitions.Machine` from `TRANSITIONS`.

    Bookkeeping only: `destination(trigger)` looks an edge up, `move(trigger)` takes it (or
    raises `TransitionRefused`). No callbacks run here; whoever drives the core runs the work.
    """

    def __init__(self, initial: State = State.INIT):
        self._model = _Model()
        self._machine = transitions.Machine(
            model=self._model,
            states=[s.value for s in State],
            initial=initial.value,
            transitions=[{"trigger": t.trigger.value, "source": [s.value for s in t.sources],
                          "dest": t.dest.value} for t in TRANSITIONS],
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )
        self._attribute = self._machine.model_attribute
        # The edges, read back from the machine (not from the table a second time).
        self._edges = {(State(src), Trigger(trigger)): State(t.dest)
                       for trigger, event in self._machine.events.items()
                       for src, edges in event.transitions.items() for t in edges}

    @property
    def state(self) -> State:
        return _STATES[self._model.state]

    def destination(self, trigger: Trigger) -> State | None:
        """Where `trigger` leads from the current state; None when the table has no such edge."""
        return self._edges.get((_STATES[self._model.state], trigger))

    def edge(self, trigger: Trigger) -> tuple[State, State | None]:
        """(the current state, `destination(trigger)`) in one lookup."""
        src = _STATES[self._model.state]
        return src, self._edges.get((src, trigger))

    def move(self, trigger: Trigger) -> State:
        """Take the edge of `trigger` from the current state.

        The edge comes from the edges read back from the machine. Taking it writes the model's
        state attribute (`transitions` keeps the state there, under `model_attribute`): what
        `trigger()` ends with when no callbacks are registered, and what `set_state` does for
        one model, without their dispatch. It happens two or three times a step, each time
        right after a forward or vLLM's scheduler evicted the CPU caches: there `set_state`
        costs about 8 us a call (cold), the attribute write well under 1 us."""
        dst = self.destination(trigger)
        if dst is None:
            raise TransitionRefused(
                f"trigger {trigger.value!r} is not allowed from state {self._model.state!r}")
        self.take(dst)
        return dst

    def advance(self, trigger: Trigger) -> tuple[State, State | None]:
        """`edge` and, when the table has the edge, `take` in one call: (the state left, the
        state entered; None when refused, nothing moved). For a driver that records its
        transitions itself (the vLLM worker's `StepMachine`, two or three times a step, each
        right after vLLM evicted the CPU caches: every call saved there is a microsecond)."""
        src = _STATES[self._model.state]
        dst = self._edges.get((src, trigger))
        if dst is not None:
            setattr(self._model, self._attribute, _VALUES[dst])
        return src, dst

    def take(self, dst: State) -> None:
        """Write `dst` as the state: for a `dst` that `edge` or `destination` just returned."""
        setattr(self._model, self._attribute, _VALUES[dst])

    def force(self, state: State) -> None:
        """Put the machine in `state` without an edge (tests that start from any state)."""
        self._machine.set_state(state.value, self._model)


class _Driver:
    """What both drivers share: the handlers, the records, the refusal and the fault edge."""

    def __init__(self, handlers: Mapping[Trigger, Handler], *, on_record: Recorder,
                 on_fault: Callable[[BaseException], None]):
        if Trigger.FAULT in handlers:
            raise ValueError("the fault edge runs no work: it must not be able to fail")
        self._handlers = {t: h for t, h in handlers.items() if h.before or h.after}
        self._on_record = on_record
        self._on_fault = on_fault
        self._running: Trigger | None = None
        self.core = TransitionCore()
        self.fault_cause: BaseException | None = None

    @property
    def state(self) -> State:
        return self.core.state

    def _start(self, trigger: Trigger) -> tuple[State, Handler | None]:
        """Check `trigger` before any work: refused triggers are logged and raised."""
        if not isinstance(trigger, Trigger):
            raise TypeError(f"triggers are Trigger members, got {trigger!r}")
        if self._running is not None:
            raise RuntimeError(f"trigger {trigger.value!r} fired while {self._running.value!r}"
                               " is running: a replica runs one trigger at a time")
        src = self.core.state
        if self.core.destination(trigger) is None:
            self._refuse(trigger, src)
        return src, self._handlers.get(trigger)

    def _refuse(self, trigger: Trigger, src: State) -> None:
        self._on_record(trigger, src, src, "refused")
        raise TransitionRefused(f"trigger {trigger.value!r} is not allowed from state {src.value!r}")

    def _enter_fault(self, error: BaseException) -> None:
        if self.core.state in _ENDED:
            return
        self.fault_cause = error
        self._on_fault(error)
        src = self.core.state
        self.core.move(Trigger.FAULT)
        self._on_record(Trigger.FAULT, src, self.core.state, "ok")

    def _succeeded(self, trigger: Trigger, src: State) -> State:
        self._running = None
        dst = self.core.state
        self._on_record(trigger, src, dst, "ok")
        return dst

    def _failed(self, trigger: Trigger, src: State, error: BaseException) -> None:
        self._running = None
        if isinstance(error, asyncio.CancelledError):
            self._on_record(trigger, src, self.core.state, "cancelled")
            return
        self._on_record(trigger, src, self.core.state, "error")
        self._enter_fault(error)


class ReplicaMachine(_Driver):
    """One replica's states, driven only through `fire`, one trigger at a time (async work).

    `on_record(trigger, src, dst, outcome)` receives one call per trigger; `on_fault(error)`
    one per fault, before the `fault` transition itself.
    """

    def __init__(self, handlers: Mapping[Trigger, Handler], *,
                 on_record: Recorder = lambda *a: None,
                 on_fault: Callable[[BaseException], None] = lambda e: None):
        super().__init__(handlers, on_record=on_record, on_fault=on_fault)

    async def fire(self, trigger: Trigger, event: Any = None) -> State:
        """Run `trigger`; on error fault the replica and re-raise the cause."""
        src, handler = self._start(trigger)
        self._running = trigger
        try:
            if handler is not None and handler.before is not None:
                pending = handler.before(event)
                if asyncio.iscoroutine(pending):
                    await pending
            self.core.move(trigger)
            if handler is not None and handler.after is not None:
                pending = handler.after(event)
                if asyncio.iscoroutine(pending):
                    await pending
        except BaseException as error:
            self._failed(trigger, src, error)
            raise
        return self._succeeded(trigger, src)

    async def fault(self, error: BaseException) -> None:
        """Move to `faulted` keeping `error` as the cause (no-op when already ended)."""
        self._enter_fault(error)
