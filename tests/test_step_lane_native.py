"""The compiled step lane (`runner_fsm/audit/_step_lane.c`, `audit.step_lane`): built and loaded
here (`make` builds it; a missing one fails this tier), declining every case it does not
write while changing nothing, safe beside another thread's writes, timed by the log's clock,
holding the file's map only while it may; the loader's reasons where it is not used.

The bytes it writes are the method's: tests/test_step_lane.py writes the same script both ways."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from runner_fsm.audit import AuditLog, read_records, step_lane
from runner_fsm.audit.compact import _NEW_STEP, decisions_tail, transition_body
from runner_fsm.audit.mapped import CHUNK, MappedFile
from runner_fsm.audit.shape import job_shape_fields

START = transition_body("decode", "ready", "decode", "ok")
FINISH = transition_body("finish", "decode", "ready", "ok")
TAIL = decisions_tail(77, None)  # a `finish` of a step whose decisions did not change


def test_the_compiled_lane_is_built_and_loaded():
    """A checkout's `make` builds it, the package's build where a compiler is: here it runs."""
    assert step_lane.status() == {"compiled": True}
    assert step_lane.LaneState is not step_lane.PyLaneState


@pytest.fixture
def log(tmp_path):
    with AuditLog(tmp_path, "run-n", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)) as log:
        assert log.lane.write(0, START)  # a step begun: the renderer's state is not the initial one
        yield log


def _fields(log: AuditLog) -> tuple:
    lane = log.lane
    return lane.seq, lane.step, lane.step_t, lane.state, lane.room, log._file.size


def _declines(log: AuditLog, *args) -> None:
    before, text = _fields(log), log._file.path.read_bytes()
    assert log.lane.write(*args) is False
    assert _fields(log) == before
    assert log._file.path.read_bytes() == text


def test_it_declines_what_it_does_not_write_and_changes_nothing(log):
    """Each case the method must write: a step id that is not None or an int of 64 bits, a body
    or tail that is not bytes. Mutation seen to fail this: the step id's overflow unchecked (a
    wrapped step id written)."""
    for step_id in (1 << 64, -(1 << 70), True, 2.0, "3"):
        _declines(log, step_id, FINISH, TAIL)
    step_t, log.lane.step_t = log.lane.step_t, -1  # no time of the clock: the method's big ints
    _declines(log, 0, FINISH, TAIL)
    log.lane.step_t = step_t
    _declines(log, 0, bytearray(FINISH), TAIL)
    _declines(log, 0, FINISH, memoryview(TAIL))
    assert log.lane.write(0, FINISH, TAIL)  # the control: the same call, with plain arguments


def test_it_declines_fields_beyond_the_map_and_the_seq_and_refuses_what_c_cannot_hold(log):
    """Fields Python sets, hostile: a `room` beyond the map (2^62, or one byte past it), a
    negative one, the last seq an int64 holds: declined, nothing written; 2^64 is refused by the
    setters before C holds it. Mutation seen to fail this: `fits` without `room <= view.len`
    (the write lands outside the map: the test process dies)."""
    room, seq = log.lane.room, log.lane.seq
    for hostile in (1 << 62, log._file._size + 1, -1):
        log.lane.room = hostile
        assert log.lane.write(0, FINISH, TAIL) is False
    log.lane.room = room
    log.lane.seq = (1 << 63) - 1
    assert log.lane.write(0, FINISH, TAIL) is False
    log.lane.seq = seq
    for name in ("room", "seq", "step_t"):
        with pytest.raises(OverflowError):
            setattr(log.lane, name, 1 << 64)
    assert (log.lane.room, log.lane.seq) == (room, seq)
    assert log.lane.write(0, FINISH, TAIL)  # the control: the fields put back, it writes


def test_it_declines_while_another_writer_holds_the_lock(log):
    """Mutation seen to fail this: the write not taking the log's lock (it writes)."""
    with log._lock:
        _declines(log, 0, FINISH, TAIL)
    assert log.lane.write(0, FINISH, TAIL)


def test_it_declines_while_a_signal_handlers_record_waits(log):
    """A record a handler left (`write_in_handler` in the writing thread): the method writes
    after it, in order. Mutation seen to fail this: the deferred queue not looked at."""
    log._deferred.append((time.monotonic_ns(), "stop", 0, {"source": "signal", "signal": "SIGTERM", "detail": ""}))
    _declines(log, 0, FINISH, TAIL)
    log.step_transition(0, FINISH, TAIL)  # what `StepMachine.fire` does next
    events = [r["event"] for r in read_records(log.path)]
    assert events[-2:] == ["transition", "stop"] and not log._deferred


def test_it_declines_on_a_closed_or_plain_log(tmp_path, log):
    """Closed: the map let go, no room, nothing written. Mutation seen to fail this:
    `MappedFile.close` not letting the lane's map go (BufferError: the map cannot close)."""
    log.close()
    assert log.lane.write(1, START) is False and not log.lane.attached and log.lane.room == 0
    with AuditLog(tmp_path / "plain", "run-p", 0, 0, 0) as plain:  # written in full: the method's
        assert plain.lane.open is False
        _declines(plain, 0, START)


def test_it_declines_a_line_that_may_not_fit_and_the_method_grows_the_file(log):
    """A line whose header may not fit what is left of the map (its bound, not its length: the
    time's digits are known only under the lock). Mutation seen to fail this: room checked
    against the line without its header's bound."""
    big = b',"pad":"' + b"x" * 2000 + b'"'
    while log.lane.room > 4000:
        assert log.lane.write(0, FINISH, big)
    # 30 bytes left for the header: `{"t":N,` fits them, the bound (80) does not
    tail = b',"pad":"' + b"y" * (log.lane.room - len(FINISH) - 2 - 30 - 9) + b'"'
    _declines(log, 0, FINISH, tail)
    log.step_transition(0, FINISH, tail + big)  # the method grows the file, the map is attached again
    assert log.lane.attached and log.lane.room > CHUNK // 2
    assert log.lane.write(1, START)
    records = list(read_records(log.path))
    assert [r["seq"] for r in records] == list(range(len(records)))
    assert records[-1]["step_id"] == 1 and records[-2]["trigger"] == "finish" and len(records[-2]["pad"]) == 2000


def test_its_times_are_the_logs_clock(log):
    """`t` from CLOCK_MONOTONIC, as `time.monotonic_ns` reads it, in the compact encoding's
    microseconds (each step's first record counts from the last one's, floored: read back, a
    time may be early by a microsecond a step). Mutation seen to fail this: the step's time not
    kept (a later step's `t` from the segment's start)."""
    spans = []
    for step in range(1, 4):
        start = time.monotonic_ns()
        assert log.lane.write(step, START)
        time.sleep(0.002)
        assert log.lane.write(step, FINISH, TAIL)
        spans.append((start, time.monotonic_ns()))
    records = [r for r in read_records(log.path) if r["event"] == "transition" and r["step_id"] in (1, 2, 3)]
    for (start, end), first, last in zip(spans, records[::2], records[1::2]):
        assert start - 10_000 <= first["t_ns"] <= last["t_ns"] <= end
        assert last["t_ns"] - first["t_ns"] >= 2_000_000 - 1000


def test_it_keeps_order_and_seq_beside_another_threads_writes(log):
    """A thread writing through the general path while the lane writes steps: every record once,
    seq gapless, each line whole, no error in either thread. Mutation seen to fail this: the lane
    writing whether or not it got the lock (it releases the other thread's lock under it)."""
    done, errors = threading.Event(), []

    def other():
        try:
            while not done.is_set():
                log.gate(None, 1)
        except BaseException as error:  # noqa: BLE001 - the test names it below
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads swap often: inside each other's writes too
    thread = threading.Thread(target=other)
    thread.start()
    try:
        declined = 0
        for step in range(1, 3001):
            for body, tail in ((START, b""), (FINISH, TAIL)):
                if not log.lane.write(step, body, tail):
                    declined += 1
                    log.step_transition(step, body, tail)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    records = list(read_records(log.path))
    assert [r["seq"] for r in records] == list(range(len(records)))
    transitions = [(r["step_id"], r["trigger"]) for r in records if r["event"] == "transition"]
    assert transitions[-6000:] == [(s, t) for s in range(1, 3001) for t in ("decode", "finish")]
    assert sum(r["event"] == "gate" for r in records) > 0


def test_the_file_holds_its_map_in_the_lane_only_while_it_may(tmp_path):
    """Attached once the file is open, let go for each resize and at close. Mutation seen to fail
    this: `_grow` resizing without letting go (BufferError: the map has an export)."""
    lane = step_lane.LaneState()
    file = MappedFile(tmp_path / "f.jsonl", chunk=4096, lane=lane)
    assert lane.attached and lane.room == 4096
    for i in range(300):  # ~9 KB: two resizes
        file.write(b'{"i":%d,"pad":"%s"}\n' % (i, b"y" * 10))
    assert lane.attached and file.size == lane.room * -1 + file._size
    file.close()
    assert not lane.attached and lane.room == 0
    with pytest.raises(ValueError, match="closed"):
        file.write(b"{}\n")


def test_a_fresh_state_begins_no_step(tmp_path):
    assert step_lane.LaneState().step is _NEW_STEP
    assert step_lane.PyLaneState().step is _NEW_STEP


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """`step_lane.load` pointed at a copy of the source in tmp_path."""
    source = tmp_path / "_step_lane.c"
    source.write_bytes(step_lane.SOURCE.read_bytes())
    monkeypatch.setattr(step_lane, "SOURCE", source)
    monkeypatch.setattr(step_lane, "BUILD_ERROR", tmp_path / "_step_lane.build-error")
    monkeypatch.delenv("RUNNER_FSM_NATIVE", raising=False)
    return source


def test_the_loader_takes_the_module_built_from_the_source_beside_it(loader):
    module, why_not = step_lane.load()
    assert module is not None and why_not is None


def test_the_loader_refuses_a_module_built_from_other_source(loader):
    loader.write_bytes(loader.read_bytes() + b"\n/* changed */\n")
    module, why_not = step_lane.load()
    assert module is None and "was built from other source" in why_not and "rebuild it" in why_not


def test_the_loader_says_why_without_a_module(loader, monkeypatch):
    monkeypatch.setattr(step_lane, "MODULE", "runner_fsm.audit._no_such_lane")
    assert step_lane.load() == (None, step_lane.load()[1])
    assert "is not built" in step_lane.load()[1]
    step_lane.BUILD_ERROR.write_text("building runner_fsm/audit/_step_lane.c failed: CompileError: no Python.h\n")
    assert "was not built when this package was installed: building" in step_lane.load()[1]
    monkeypatch.setenv("RUNNER_FSM_NATIVE", "0")
    assert step_lane.load() == (None, "turned off by RUNNER_FSM_NATIVE=0")


def test_the_widest_header_is_written_whole(tmp_path):
    """The widest header the lane writes (72 bytes: a step id of 20 characters, a seq of 19, a
    time 2^62 ns back): the lane's line is the method's. Mutation seen to fail this: a header
    bound of 60 (the lane declines it)."""
    lines = {}
    for writer in ("lane", "method"):
        with AuditLog(tmp_path / writer, "run-w", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)) as log:
            log.lane.seq, log.lane.step_t = (1 << 63) - 10, 1 << 62
            for step in (-(1 << 63), (1 << 63) - 1, None):
                if writer == "method":
                    log.step_transition(step, START)
                else:
                    assert log.lane.write(step, START)
        text = (tmp_path / writer / "rank-0.jsonl").read_bytes()
        lines[writer] = text.splitlines()[1:]
    assert [re.sub(rb'"t":-?\d+,', b"", line) for line in lines["lane"]] == \
        [re.sub(rb'"t":-?\d+,', b"", line) for line in lines["method"]]
    first = lines["lane"][0]
    assert re.match(rb'\{"s":-9223372036854775808,"q":9223372036854775798,"t":-46\d{14},', first), first


def test_a_state_made_without_init_declines():
    lane = step_lane.LaneState.__new__(step_lane.LaneState)
    assert lane.step is None and lane.state is None
    assert lane.write(0, START) is False
