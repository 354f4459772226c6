"""The async driver: one task per replica consumes its event stream and drives the machine.

Events arrive on an anyio memory object stream; each one becomes the triggers of the
transition table (a step is `prefill|decode|idle`, then `draft` when drafting, then
`finish`). An outcome goes back for every event, in order. After a fault or a shutdown
the remaining events are refused with the reason, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from runner_fsm import dp
from runner_fsm.errors import BatchError, CollectiveTimeout, DesyncError, ReplicaFault, RunnerError
from runner_fsm.events import Capture, DummyStep, Event, Fault, RealStep, Shutdown
from runner_fsm.replica.replica import Replica, StepOutput
from runner_fsm.states import State, Trigger


class EventRefused(RunnerError):
    """An event that arrived after the replica faulted or stopped."""


@dataclasses.dataclass(frozen=True, eq=False)
class Outcome:
    """The answer to one event: its step output, or the error that ended it."""

    event: Event
    output: StepOutput | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _abort_status(error: BaseException) -> int:
    return dp.STATUS_BATCH_ERROR if isinstance(error, BatchError) else dp.STATUS_FAULT


class ReplicaRunner:
    """Drives one replica; `on_close` destroys its process groups at shutdown."""

    def __init__(self, replica: Replica, *, on_close: Callable[[], Any] | None = None):
        self.replica = replica
        self.machine = replica.machine
        self._on_close = on_close
        self.ended_reason: str | None = None

    async def handle(self, event: Event) -> StepOutput | None:
        """Run one event to completion; on error the replica is faulted and peers told."""
        if self.ended_reason is not None:
            raise EventRefused(f"replica {self.replica.dp_rank} refuses {type(event).__name__}:"
                               f" {self.ended_reason}")
        try:
            return await self._dispatch(event)
        except BaseException as error:
            if self.machine.state is State.FAULTED:
                self.ended_reason = f"faulted at step {self.replica.step_id}: {error}"
                await self._tell_peers(error)
            raise

    async def _dispatch(self, event: Event) -> StepOutput | None:
        fire = self.machine.fire
        if isinstance(event, Capture):
            for trigger in Capture.triggers:
                await fire(trigger, event)
            return None
        if isinstance(event, (RealStep, DummyStep)):
            await fire(event.trigger, event)
            if self.replica.drafting and not self.replica.fault_due("skip-draft-sync"):
                await fire(Trigger.DRAFT, event)
            await fire(Trigger.FINISH, event)
            return self.replica.output
        if isinstance(event, Shutdown):
            await fire(Trigger.SHUTDOWN, event)
            self.ended_reason = f"stopped: {event.reason}"
            return None
        if isinstance(event, Fault):
            await self.machine.fault(event.error)
            self.ended_reason = f"faulted: {event.error}"
            return None
        raise TypeError(f"not a runner event: {event!r}")

    async def _tell_peers(self, error: BaseException) -> None:
        # A peer's abort or a desync already reached everyone through the agreement;
        # an error of our own before this step's agreement must be announced in it. After a
        # timeout the peers are stuck or gone and time out by themselves at about the same
        # moment: announcing it would only keep this process another full timeout.
        if isinstance(error, (ReplicaFault, DesyncError, CollectiveTimeout)) or self.replica.agreed_this_step:
            return
        if self.replica.config.layout.dp_size > 1:
            with anyio.CancelScope(shield=True):
                await self.replica.abort_peers(_abort_status(error))

    async def serve(self, events: ObjectReceiveStream[Event], outcomes: ObjectSendStream[Outcome]) -> None:
        """Consume `events` until the stream closes; one `Outcome` per event, in order."""
        async with events, outcomes:
            async for event in events:
                try:
                    outcome = Outcome(event, output=await self.handle(event))
                except Exception as error:
                    outcome = Outcome(event, error=error)
                await outcomes.send(outcome)
        await self.close()

    async def close(self) -> None:
        """Destroy groups and flush the log (idempotent)."""
        self.replica.collectives.close()
        if self.replica.audit is not None:
            self.replica.audit.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
