"""The closed vocabulary of events a replica consumes.

Each event is a small frozen dataclass. The driver turns an event into triggers of the
transition table (a step's `draft` trigger comes from the configuration, not from an event);
nothing else in the code triggers a transition.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Union

from runner_fsm.batch import ScheduledBatch
from runner_fsm.states import Trigger


@dataclasses.dataclass(frozen=True)
class Capture:
    """Capture the graphs of the configured sizes (none in eager mode), then be ready."""

    triggers: ClassVar[tuple[Trigger, ...]] = (Trigger.CAPTURE, Trigger.CAPTURED)


@dataclasses.dataclass(frozen=True, eq=False)
class RealStep:
    """A step with scheduled work; `batch` was validated before the event was made."""

    batch: ScheduledBatch

    @property
    def trigger(self) -> Trigger:
        return Trigger.PREFILL if self.batch.any_prefill else Trigger.DECODE


@dataclasses.dataclass(frozen=True)
class DummyStep:
    """A step with no work here: join the peers' collectives with a dummy batch.

    `pending` counts requests this replica still owes (not yet arrived or blocked): sent as
    `num_reqs`, it lets every replica see that all are idle *and* done.
    """

    pending: int = 0
    trigger: ClassVar[Trigger] = Trigger.IDLE


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """Stop: refuse pending events with `reason`, destroy groups, flush logs."""

    reason: str = "shutdown requested"
    trigger: ClassVar[Trigger] = Trigger.SHUTDOWN


@dataclasses.dataclass(frozen=True)
class Fault:
    """An error from outside a transition (for example a peer's abort) ends the replica."""

    error: BaseException
    trigger: ClassVar[Trigger] = Trigger.FAULT


Event = Union[Capture, RealStep, DummyStep, Shutdown, Fault]

__all__ = ["Capture", "DummyStep", "Event", "Fault", "RealStep", "Shutdown"]
