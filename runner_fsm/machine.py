"""The replica state machine: `transitions`' AsyncMachine, made safe for collectives.

Three changes to AsyncMachine (transitions 0.9.3) and why:
- callbacks of one hook run one after another in the calling task: the stock machine runs
  them concurrently with `asyncio.gather`, which would issue collectives in a racy order;
- it never cancels a running transition: the stock machine cancels other tasks of the
  model when a transition starts, and a task inside a collective must not be cancelled;
- a `CancelledError` propagates: the stock machine turns it into a `False` result, which
  would report a cancelled or timed-out trigger like a refused one and lose the cancel.

Work is attached per trigger as `Handler(before, after)`: `before` runs in the source state
(validation, so a bad batch leaves everything untouched), `after` runs in the destination
state (the step's work). Any exception moves the replica to `faulted` through the table's
`fault` edge, with the cause kept and logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Mapping, Optional

from transitions import MachineError
from transitions.extensions import asyncio as _transitions_asyncio
from transitions.extensions.asyncio import AsyncMachine

from runner_fsm.errors import RunnerError
from runner_fsm.states import TRANSITIONS, State, Trigger

Callback = Callable[[Any], Optional[Awaitable[None]]]

# transitions logs eight debug lines per trigger; on the per-step path even the disabled-level
# checks cost several microseconds, so its asyncio module's debug calls become no-ops.
# Errors and warnings still reach logging.
_transitions_asyncio._LOGGER.debug = lambda *args, **kwargs: None
_STATES = {s.value: s for s in State}


class TransitionRefused(RunnerError):
    """A trigger that the transition table does not allow from the current state."""


@dataclasses.dataclass(frozen=True)
class Handler:
    """Work bound to one trigger: `before` in the source state, `after` in the destination."""

    before: Callback | None = None
    after: Callback | None = None


class _SerialAsyncMachine(AsyncMachine):
    """AsyncMachine whose callbacks run serially and whose cancellations propagate."""

    @staticmethod
    async def await_all(callables):
        return [await func() for func in callables]

    async def callbacks(self, funcs, event_data):
        # One after another; most hooks are empty, so skip building partials for them.
        for func in funcs:
            await self.callback(func, event_data)

    async def cancel_running_transitions(self, model, msg=None):
        return None

    def __getattr__(self, name):
        # transitions probes `hasattr(machine, "model_graphs")` on every state change; the
        # stock __getattr__ parses callback-name patterns first, which costs more than the
        # whole rest of a trigger.
        if name == "model_graphs":
            raise AttributeError(name)
        return super().__getattr__(name)

    async def process_context(self, func, model):
        # The stock version records the running task (for the cancellation above, which is
        # off) and turns CancelledError into False; here a cancel simply propagates.
        return await self._process_async(func, model)


class ReplicaMachine:
    """One replica's states, driven only through `fire`, one trigger at a time.

    `on_record(trigger, src, dst, outcome)` receives one call per trigger; `on_fault(error)`
    one per fault, before the `fault` transition itself.
    """

    def __init__(
        self,
        handlers: Mapping[Trigger, Handler],
        *,
        on_record: Callable[[Trigger, State, State, str], None] = lambda *a: None,
        on_fault: Callable[[BaseException], None] = lambda e: None,
    ):
        self._handlers = dict(handlers)
        self._on_record = on_record
        self._on_fault = on_fault
        self._error: BaseException | None = None
        self._error_state: State | None = None
        self.fault_cause: BaseException | None = None
        self._machine = _SerialAsyncMachine(
            model=self,
            states=[s.value for s in State],
            initial=State.INIT.value,
            transitions=[self._edge(t) for t in TRANSITIONS],
            auto_transitions=False,
            queued=True,
            ignore_invalid_triggers=False,
            send_event=True,
            on_exception=self._keep_error,
            model_attribute="_fsm_state",
        )

    def _edge(self, t) -> dict:
        handler = self._handlers.get(t.trigger, Handler())
        edge = {"trigger": t.trigger.value, "source": [s.value for s in t.sources], "dest": t.dest.value}
        if handler.before:
            edge["before"] = [self._unwrap(handler.before)]
        if handler.after:
            edge["after"] = [self._unwrap(handler.after)]
        return edge

    @staticmethod
    def _unwrap(callback: Callback):
        async def call(event_data):
            result = callback(event_data.kwargs.get("event"))
            if asyncio.iscoroutine(result):
                await result

        return call

    def _keep_error(self, event_data) -> None:
        self._error = event_data.error
        self._error_state = _STATES[self._fsm_state]

    @property
    def state(self) -> State:
        return _STATES[self._fsm_state]

    async def fire(self, trigger: Trigger, event: Any = None) -> State:
        """Run `trigger`; on error fault the replica and re-raise the cause."""
        if not isinstance(trigger, Trigger):
            raise TypeError(f"triggers are Trigger members, got {trigger!r}")
        src = self.state
        self._error, self._error_state = None, None
        try:
            await self._machine.events[trigger.value].trigger(self, event=event)
        except asyncio.CancelledError:
            self._on_record(trigger, src, self.state, "cancelled")
            raise
        error, reached = self._error, self._error_state
        if isinstance(error, MachineError):
            self._on_record(trigger, src, self.state, "refused")
            raise TransitionRefused(
                f"trigger {trigger.value!r} is not allowed from state {src.value!r}"
            ) from None
        if isinstance(error, asyncio.CancelledError):
            self._on_record(trigger, src, reached, "cancelled")
            raise error
        if error is not None:
            self._on_record(trigger, src, reached, "error")
            await self.fault(error)
            raise error
        self._on_record(trigger, src, self.state, "ok")
        return self.state

    async def fault(self, error: BaseException) -> None:
        """Move to `faulted` keeping `error` as the cause (no-op when already ended)."""
        if self.state in (State.FAULTED, State.STOPPED):
            return
        self.fault_cause = error
        self._on_fault(error)
        src = self.state
        self._error = None
        await self._machine.events[Trigger.FAULT.value].trigger(self, event=error)
        self._on_record(Trigger.FAULT, src, self.state, "ok" if self._error is None else "error")
