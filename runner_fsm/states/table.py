"""The replica's states and its one transition table, as data.

The runtime machine (`runner_fsm.states.machine`), the Mermaid diagram (`runner-fsm states`,
docs/states.md) and the replay legality check are all built from `TRANSITIONS`; no
transition exists anywhere else.
"""

from __future__ import annotations

import dataclasses
import enum


class State(str, enum.Enum):
    INIT = "init"
    CAPTURING = "capturing"
    READY = "ready"
    PREFILL = "prefill"
    DECODE = "decode"
    IDLE_DUMMY = "idle_dummy"
    DRAFT_SYNC = "draft_sync"
    FAULTED = "faulted"
    STOPPED = "stopped"


class Trigger(str, enum.Enum):
    CAPTURE = "capture"  # init -> capturing: capture graphs (none in eager mode)
    CAPTURED = "captured"  # capturing -> ready
    PREFILL = "prefill"  # a real step with at least one prefilling request
    DECODE = "decode"  # a real step of decode (and verify) rows only
    IDLE = "idle"  # no work here while peers may have some: run the dummy batch
    DRAFT = "draft"  # replicated draft: fresh DP agreements on every replica
    FINISH = "finish"  # the step is over
    FAULT = "fault"  # any error: the cause is kept and logged
    SHUTDOWN = "shutdown"


STEP_STATES = (State.PREFILL, State.DECODE, State.IDLE_DUMMY)
LIVE_STATES = tuple(s for s in State if s not in (State.FAULTED, State.STOPPED))


@dataclasses.dataclass(frozen=True)
class Transition:
    """One edge of the table: `trigger` moves a replica from any of `sources` to `dest`."""

    trigger: Trigger
    sources: tuple[State, ...]
    dest: State


TRANSITIONS: tuple[Transition, ...] = (
    Transition(Trigger.CAPTURE, (State.INIT,), State.CAPTURING),
    Transition(Trigger.CAPTURED, (State.CAPTURING,), State.READY),
    Transition(Trigger.PREFILL, (State.READY,), State.PREFILL),
    Transition(Trigger.DECODE, (State.READY,), State.DECODE),
    Transition(Trigger.IDLE, (State.READY,), State.IDLE_DUMMY),
    Transition(Trigger.DRAFT, STEP_STATES, State.DRAFT_SYNC),
    Transition(Trigger.FINISH, STEP_STATES + (State.DRAFT_SYNC,), State.READY),
    Transition(Trigger.FAULT, LIVE_STATES, State.FAULTED),
    Transition(Trigger.SHUTDOWN, (State.INIT, State.READY, State.FAULTED), State.STOPPED),
)


def _index() -> dict[tuple[State, Trigger], State]:
    index: dict[tuple[State, Trigger], State] = {}
    for t in TRANSITIONS:
        for src in t.sources:
            if (src, t.trigger) in index:
                raise AssertionError(f"two transitions for {t.trigger.value} from {src.value}")
            index[(src, t.trigger)] = t.dest
    return index


_NEXT = _index()


def next_state(src: State | str, trigger: Trigger | str) -> State | None:
    """Where `trigger` takes a replica in `src`, or None when the table has no such edge."""
    try:
        return _NEXT.get((State(src), Trigger(trigger)))
    except ValueError:
        return None


def is_legal(src: State | str, trigger: Trigger | str, dst: State | str) -> bool:
    """True when the table moves `src` to `dst` on `trigger` (used by replay)."""
    expected = next_state(src, trigger)
    return expected is not None and expected.value == State(dst).value


def mermaid() -> str:
    """The table as a Mermaid stateDiagram-v2 (docs/states.md holds this text)."""
    lines = ["stateDiagram-v2", f"    [*] --> {State.INIT.value}"]
    for t in TRANSITIONS:
        for src in t.sources:
            lines.append(f"    {src.value} --> {t.dest.value}: {t.trigger.value}")
    lines.append(f"    {State.STOPPED.value} --> [*]")
    return "\n".join(lines) + "\n"
