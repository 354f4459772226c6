"""Batches of audit records (the vLLM worker writes the end of a step in one write) and the
line renderer (a per-log header template: the same bytes as rendering the whole record)."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.compact import CompactRenderer
from runner_fsm.audit.records import plain_fields
from runner_fsm.audit.render import BuffersTemplate, RecordRenderer, cached_body, dumps_record


@pytest.fixture
def log(tmp_path):
    with AuditLog(tmp_path, "run-b", global_rank=0, dp_rank=0, pcp_rank=0) as audit:
        yield audit


def on_disk(log: AuditLog) -> list[tuple[int, str, int | None, str]]:
    out = []
    for r in read_records(log.path):
        what = r.get("trigger") or r.get("stage") or r.get("reason") or r.get("error")
        out.append((r["seq"], r["event"], r["step_id"], what))
    return out


def test_a_batch_is_written_at_write_in_one_go(log):
    batch = log.batch()
    batch.transition(0, "decode", "ready", "decode", "ok")
    batch.buffers(0, "real", {"seq_lens": {"ptr": 8, "shape": [4], "version": 7}})
    assert on_disk(log) == []
    log.collective(0, "dp", "all_reduce", 1, [[9, 2]], 0, "enqueue")  # straight to the log
    assert on_disk(log) == [(0, "collective", 0, "enqueue")]
    batch.write()
    assert on_disk(log)[1:] == [(1, "transition", 0, "decode"), (2, "buffers", 0, "real")]
    batch.write()  # nothing left: nothing written
    assert log.next_seq == 3


def test_records_of_batches_and_of_another_thread_each_land_once_in_order(log):
    """One thread logs steps in batches, another writes straight to the log meanwhile: every
    record lands once, seq is gapless, and each thread's own records keep their order."""
    steps, direct = 300, 400

    def stepper():
        for step in range(steps):
            batch = log.batch()
            batch.transition(step, "decode", "ready", "decode", "ok")
            batch.transition(step, "finish", "decode", "ready", "ok")
            batch.write()

    def other():
        for i in range(direct):
            log.collective(i, "dp", "all_reduce", 1, [[1]], i, "enqueue")

    threads = [threading.Thread(target=stepper), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = list(read_records(log.path))
    assert [r["seq"] for r in records] == list(range(2 * steps + direct))
    mine = [(r["step_id"], r["trigger"]) for r in records if r["event"] == "transition"]
    assert mine == [(s, t) for s in range(steps) for t in ("decode", "finish")]
    assert [r["step_id"] for r in records if r["event"] == "collective"] == list(range(direct))


@pytest.mark.parametrize("run_id", ["run-1", 'quo"te', "pct-%d-%s", "ünï"])
@pytest.mark.parametrize("step_id", [None, 0, 12345678901])
@pytest.mark.parametrize("fields", [
    {"trigger": "decode", "src": "ready", "dst": "decode", "outcome": "ok"},
    {"reason": "real", "buffers": {"seq_lens": {"ptr": 1, "shape": [4], "version": -3}}},
    {"group": "dp", "shapes": [[np.int64(9), 2]], "sent": np.arange(3)},
    {},
])
def test_rendered_line_is_the_whole_record_rendered(run_id, step_id, fields):
    render = RecordRenderer(1, run_id, 2, 1)
    line = render.line(7, 123456789, "transition", step_id, fields)
    whole = {"schema": 1, "run_id": run_id, "seq": 7, "t_ns": 123456789, "dp_rank": 2, "pcp_rank": 1,
             "event": "transition", "step_id": step_id, **fields}
    assert line == dumps_record(whole)
    assert json.loads(line) == json.loads(dumps_record(whole))


@pytest.mark.parametrize("names", [("slot_mapping", "seq_lens"), ('q"uote', "pct%d", "ünï")])
@pytest.mark.parametrize("reason", ["real", "replay", 'odd"%s'])
@pytest.mark.parametrize("extra", [{}, {"copied": ["input_ids"], "graph_tokens": 8}])
def test_buffers_template_renders_what_the_encoder_renders(names, reason, extra):
    values = []
    for i, _ in enumerate(names):  # addresses, sizes, stamps, signed 64-bit hashes, rows (0 too)
        values += (0x7F00_0000_0000 + i, 64 + i, i, -(2**63) + i if i % 2 else 2**63 - 1 - i, i * 7)
    whole = {"reason": reason, "buffers": {name: {"ptr": values[5 * i], "shape": [values[5 * i + 1]],
                                                  "version": values[5 * i + 2], "digest": values[5 * i + 3],
                                                  "rows": values[5 * i + 4]}
                                           for i, name in enumerate(names)}, **extra}
    tail = b"".join(b"," + dumps_record(k) + b":" + dumps_record(v) for k, v in extra.items())
    template = BuffersTemplate(names)
    # Compact bodies (`audit.compact`) that read back as the whole record, as the builder's does.
    assert plain_fields("buffers", template.body(reason, tuple(values), tail)) == whole
    assert plain_fields("buffers", template.body(reason, tuple(values), tail)) == whole  # its cached reason too
    assert plain_fields("buffers", CompactRenderer(0)._body("buffers", 0, dict(whole))) == whole


def test_cached_body_is_rendered_once_per_key():
    cache: dict = {}
    fields = {"trigger": "finish", "src": "decode", "dst": "ready", "outcome": "ok"}
    first = cached_body(cache, ("k",), fields)
    assert first == dumps_record(fields)
    assert cached_body(cache, ("k",), {"ignored": True}) is first  # the key decides


def test_a_rendered_record_is_the_record_its_builder_writes(tmp_path):
    names = ("slot_mapping", "seq_lens")
    body = BuffersTemplate(names).body("dummy", (16, 8, 1, -5, 3, 32, 4, 1, 7, 2))
    with AuditLog(tmp_path / "a", "run", 0, 0, 0) as built, AuditLog(tmp_path / "b", "run", 0, 0, 0) as fast:
        built.buffers(4, "dummy", {"slot_mapping": {"ptr": 16, "shape": [8], "version": 1, "digest": -5, "rows": 3},
                                   "seq_lens": {"ptr": 32, "shape": [4], "version": 1, "digest": 7, "rows": 2}})
        fast.rendered("buffers", 4, body)
        batch = fast.batch()
        batch.transition(4, "finish", "decode", "ready", "ok")
        batch.write()
        built.transition(4, "finish", "decode", "ready", "ok")
    def lines(path):  # the bytes of each line, its time made equal
        return [re.sub(rb'"t_ns":\d+', b'"t_ns":0', line) for line in path.read_bytes().splitlines()]

    assert lines(built.path) == lines(fast.path)
    assert len(lines(fast.path)) == 2


@pytest.mark.parametrize("event, body", [("buffer", b"{}"), ("buffers", b"[1]"), ("buffers", "{}")])
def test_a_rendered_record_must_be_a_known_event_and_an_object(log, event, body):
    with pytest.raises(ValueError, match="rendered|audit event"):
        log.rendered(event, 0, body)
    assert log.next_seq == 0


def test_rendered_lines_are_the_lines_of_each_record():
    """`lines` (a batch in one call) is `line` of each record, numbered on, `now` for no time."""
    render = RecordRenderer(1, "run-%d", 0, 0)
    records = [(5, "transition", 3, {"trigger": "finish"}), (None, "graph", None, b'{"action":"replay"}'),
               (7, "buffers", 4, b"{}")]
    assert render.lines(10, records, 99) == b"\n".join([render.line(10, 5, "transition", 3, {"trigger": "finish"}),
                                                        render.line(11, 99, "graph", None, b'{"action":"replay"}'),
                                                        render.line(12, 7, "buffers", 4, b"{}")])
    assert render.lines(0, records[:1], 1) == render.line(0, 5, "transition", 3, {"trigger": "finish"})


def test_compact_times_read_back_exactly_over_100k_steps(tmp_path):
    """A compact log's times come back within a microsecond of the times written, at the last of
    100,000 steps as at the first: each step's gap is written in whole microseconds from the
    time a reader rebuilds, not from the writer's exact clock (which let a reader fall up to a
    microsecond behind per step: 0.1 s here). Mutation: `_head` keeping the exact time -> the
    last step reads back ~50 ms early."""
    from runner_fsm.audit.expand import Expander

    t0 = 1_000_000_000_123
    job = {"t_ns": t0, "seq": 0, "schema": 2, "run_id": "r", "dp_rank": 0, "pcp_rank": 0}
    renderer, expand = CompactRenderer(t0), Expander(job)
    body = b'{"tr":["decode","ready","decode"]}'
    worst = 0
    for step in range(100_000):
        written = t0 + step * 1_234_567 + 499  # sub-microsecond parts, as a monotonic clock has
        line = renderer.transition(step + 1, step, written, body)
        record = expand(json.loads(line))
        assert 0 <= written - record["t_ns"] < 1000, (step, written, record["t_ns"])
        worst = max(worst, written - record["t_ns"])
    assert worst > 0  # the gaps were rounded: the test saw sub-microsecond parts


def test_a_deferred_record_written_by_another_thread_leaves_no_blank_line(tmp_path):
    """Two threads flush the records queued for a signal handler (`write_in_handler`): the one
    that gets the lock second finds the queue empty and writes nothing. It wrote an empty line
    (a "blank line inside the audit log" for every reader) when the compressor's thread said a
    failure while a step's write flushed the queue. Mutation: `_write_deferred` without its
    `records and` -> a blank line."""
    log = AuditLog(tmp_path, "run-d", 0, 0, 0)
    log.transition(1, "decode", "ready", "decode", "ok")
    log._deferred.append((0, "stop", 1, {"source": "shutdown", "signal": None, "detail": ""}))
    log._lock.acquire()  # a write in progress: the other thread saw the queue and waits for the lock
    waiting = threading.Thread(target=log._write_deferred, kwargs={"wait_s": 5.0})
    waiting.start()
    time.sleep(0.2)
    # the write in progress flushes the queue before it lets go (as `_write_all`'s `finally` does)
    records = [log._deferred.popleft()]
    log._logger.msg(log._render_lines(log.lane.seq, records, time.monotonic_ns()))
    log.lane.seq += 1
    log._lock.release()
    waiting.join()
    log.transition(1, "finish", "decode", "ready", "ok")
    log.close()
    lines = log.path.read_bytes().split(b"\n")
    assert b"" not in lines[:-1], lines
    assert [r["event"] for r in read_records(log.path)] == ["transition", "stop", "transition"]
