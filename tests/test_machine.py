"""The replica state machine: legal and illegal triggers, faults, cancellation."""

import asyncio

import anyio
import pytest

from runner_fsm.states.machine import Handler, ReplicaMachine, TransitionCore, TransitionRefused
from runner_fsm.states import TRANSITIONS, State, Trigger, next_state



def _recording_machine(handlers=None):
    records = []
    machine = ReplicaMachine(handlers or {}, on_record=lambda *r: records.append(r))
    return machine, records


def _force(machine: ReplicaMachine, state: State) -> None:
    machine.core.force(state)  # test-only: start from any state


# Every legal edge (src, trigger, dst), written out by hand from DESIGN section 6, not read from
# the table under test: a changed table fails here until this list is changed with it.
EXPECTED_EDGES = [
    ("init", "capture", "capturing"),
    ("capturing", "captured", "ready"),
    ("ready", "prefill", "prefill"),
    ("ready", "decode", "decode"),
    ("ready", "idle", "idle_dummy"),
    ("prefill", "draft", "draft_sync"),
    ("decode", "draft", "draft_sync"),
    ("idle_dummy", "draft", "draft_sync"),
    ("prefill", "finish", "ready"),
    ("decode", "finish", "ready"),
    ("idle_dummy", "finish", "ready"),
    ("draft_sync", "finish", "ready"),
    ("init", "fault", "faulted"),
    ("capturing", "fault", "faulted"),
    ("ready", "fault", "faulted"),
    ("prefill", "fault", "faulted"),
    ("decode", "fault", "faulted"),
    ("idle_dummy", "fault", "faulted"),
    ("draft_sync", "fault", "faulted"),
    ("init", "shutdown", "stopped"),
    ("ready", "shutdown", "stopped"),
    ("faulted", "shutdown", "stopped"),
]


@pytest.mark.parametrize("src, trigger, dst", EXPECTED_EDGES)
@pytest.mark.asyncio
async def test_every_legal_transition(src, trigger, dst):
    src, trigger, dst = State(src), Trigger(trigger), State(dst)
    machine, records = _recording_machine()
    _force(machine, src)
    if trigger is Trigger.FAULT:
        await machine.fault(RuntimeError("injected"))
    else:
        await machine.fire(trigger)
    assert machine.state is dst
    assert records[-1] == (trigger, src, dst, "ok")


def test_the_table_has_exactly_the_expected_edges():
    table = {(src.value, t.trigger.value, t.dest.value) for t in TRANSITIONS for src in t.sources}
    assert table == set(EXPECTED_EDGES), (f"missing: {set(EXPECTED_EDGES) - table}; unexpected:"
                                          f" {table - set(EXPECTED_EDGES)}")


_LEGAL = {(src, trigger) for src, trigger, _ in EXPECTED_EDGES}


@pytest.mark.parametrize("src, trigger", [(s, t) for s in State for t in Trigger
                                          if t is not Trigger.FAULT and (s.value, t.value) not in _LEGAL])
@pytest.mark.asyncio
async def test_every_other_trigger_is_refused(src, trigger):
    machine, records = _recording_machine()
    _force(machine, src)
    with pytest.raises(TransitionRefused):
        await machine.fire(trigger)
    assert machine.state is src and records == [(trigger, src, src, "refused")]


@pytest.mark.parametrize("src, trigger", [
    (State.INIT, Trigger.PREFILL), (State.READY, Trigger.FINISH), (State.PREFILL, Trigger.IDLE),
    (State.DRAFT_SYNC, Trigger.DRAFT), (State.FAULTED, Trigger.DECODE), (State.STOPPED, Trigger.CAPTURE),
    (State.DECODE, Trigger.SHUTDOWN),
])
@pytest.mark.asyncio
async def test_illegal_triggers_are_refused_and_logged(src, trigger):
    machine, records = _recording_machine()
    _force(machine, src)
    with pytest.raises(TransitionRefused, match=f"'{trigger.value}' is not allowed from state '{src.value}'"):
        await machine.fire(trigger)
    assert machine.state is src
    assert records == [(trigger, src, src, "refused")]


@pytest.mark.asyncio
async def test_bare_strings_are_not_triggers():
    machine, _ = _recording_machine()
    with pytest.raises(TypeError):
        await machine.fire("capture")


@pytest.mark.asyncio
async def test_callbacks_run_in_order_in_one_task():
    seen = []

    async def after(event):
        seen.append(("after", event, asyncio.current_task()))
        await asyncio.sleep(0)
        seen.append(("after-end", event, asyncio.current_task()))

    def before(event):
        seen.append(("before", event, asyncio.current_task()))

    machine, _ = _recording_machine({Trigger.CAPTURE: Handler(before=before, after=after)})
    await machine.fire(Trigger.CAPTURE, "E")
    task = asyncio.current_task()
    assert [(s[0], s[1]) for s in seen] == [("before", "E"), ("after", "E"), ("after-end", "E")]
    assert all(s[2] is task for s in seen)


@pytest.mark.asyncio
async def test_error_in_callback_faults_with_cause():
    def boom(event):
        raise ValueError("bad block table")

    machine, records = _recording_machine({Trigger.PREFILL: Handler(after=boom)})
    _force(machine, State.READY)
    with pytest.raises(ValueError, match="bad block table"):
        await machine.fire(Trigger.PREFILL)
    assert machine.state is State.FAULTED
    assert isinstance(machine.fault_cause, ValueError)
    assert records == [(Trigger.PREFILL, State.READY, State.PREFILL, "error"),
                       (Trigger.FAULT, State.PREFILL, State.FAULTED, "ok")]


@pytest.mark.asyncio
async def test_error_in_before_faults_from_source_state():
    def invalid(event):
        raise ValueError("negative count")

    machine, records = _recording_machine({Trigger.DECODE: Handler(before=invalid)})
    _force(machine, State.READY)
    with pytest.raises(ValueError):
        await machine.fire(Trigger.DECODE)
    assert records[0] == (Trigger.DECODE, State.READY, State.READY, "error")
    assert machine.state is State.FAULTED


@pytest.mark.asyncio
async def test_timed_out_trigger_is_not_reported_as_success():
    async def hang(event):
        await anyio.sleep(30)

    machine, records = _recording_machine({Trigger.IDLE: Handler(after=hang)})
    _force(machine, State.READY)
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await machine.fire(Trigger.IDLE)
    assert records == [(Trigger.IDLE, State.READY, State.IDLE_DUMMY, "cancelled")]


@pytest.mark.asyncio
async def test_cancelled_trigger_propagates_cancellation():
    async def hang(event):
        await anyio.sleep(30)

    machine, records = _recording_machine({Trigger.CAPTURE: Handler(after=hang)})
    task = asyncio.ensure_future(machine.fire(Trigger.CAPTURE))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert records[-1][3] == "cancelled"


@pytest.mark.asyncio
async def test_fault_after_stop_is_a_no_op():
    machine, records = _recording_machine()
    await machine.fire(Trigger.SHUTDOWN)
    await machine.fault(RuntimeError("late"))
    assert machine.state is State.STOPPED
    assert machine.fault_cause is None


@pytest.mark.asyncio
async def test_a_second_trigger_while_one_runs_is_refused_and_the_first_completes():
    gate = anyio.Event()

    async def slow(event):
        await gate.wait()

    machine, records = _recording_machine({Trigger.CAPTURE: Handler(after=slow)})
    first = asyncio.ensure_future(machine.fire(Trigger.CAPTURE))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="'captured' fired while 'capture' is running"):
        await machine.fire(Trigger.CAPTURED)
    gate.set()
    assert await first is State.CAPTURING
    assert records == [(Trigger.CAPTURE, State.INIT, State.CAPTURING, "ok")]


def test_core_edges_are_the_table():
    core = TransitionCore()
    for t in TRANSITIONS:
        for src in t.sources:
            core.force(src)
            assert core.destination(t.trigger) is t.dest
            assert core.move(t.trigger) is t.dest
    core.force(State.READY)
    assert core.destination(Trigger.CAPTURE) is None
    with pytest.raises(TransitionRefused, match="'capture' is not allowed from state 'ready'"):
        core.move(Trigger.CAPTURE)
    assert core.state is State.READY
