"""A step's transition written by its short path (`AuditLog.step_transition`, the vLLM worker's
step start and step end) is the line the general path writes (`rendered` /
`rendered_transition` into a batch, `AuditBatch.write`): the same bytes, seq and order, in both
log formats, with a batch before it or not, across a step change, a step id of None, an edge
off the table's chain, the file's growth and a capped log's segment switch."""

from __future__ import annotations

import re

import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.compact import decisions_tail, transition_body
from runner_fsm.audit.segments import MIN_SEGMENT
from runner_fsm.audit.shape import job_shape_fields

START = transition_body("decode", "ready", "decode", "ok")
PREFILL = transition_body("prefill", "ready", "prefill", "ok")
FINISH = transition_body("finish", "decode", "ready", "ok")
FINISH_PREFILL = transition_body("finish", "prefill", "ready", "ok")
REFUSED = transition_body("decode", "decode", "decode", "refused")
BUFFERS = b'{"b":"real","buf":[[1,[8],3,77,4],[2,[8],3,78,4]]}'


def _script(base: int = 0):
    """(step, kind, body, tail, records collected before it): what a run of vLLM steps writes."""
    out = []
    for step in range(base, base + 12):
        start, finish = (PREFILL, FINISH_PREFILL) if step % 5 == 0 else (START, FINISH)
        out.append((step, start, b"", ()))
        before = (("buffers", BUFFERS),) if step % 2 else ()
        tail = decisions_tail(1000 + step, [1, step, 4] if step % 3 == 0 else None)
        out.append((step, finish, tail, before))
    out.append((base + 12, REFUSED, b"", ()))  # off the chain: written in full
    out.append((None, START, b"", ()))  # no step
    return out


WRITERS = ("general", "method")


def _write(log: AuditLog, writer: str, base: int = 0) -> None:
    """The script's transitions by `writer`."""
    batch = log.batch()
    for step, body, tail, before in _script(base):
        for event, record in before:
            batch.rendered(event, step, record)
        if writer == "method":
            log.step_transition(step, body, tail, batch)
            assert not batch._pending  # written with it
        else:
            if tail:
                batch.rendered_transition(step, body, tail)
            else:
                batch.rendered("transition", step, body)
            batch.write()


def _lines(path) -> list[bytes]:
    lines = []
    for name in sorted(path.iterdir()):
        text = name.read_bytes().rstrip(b"\n\x00")
        lines += [re.sub(rb'"t(_ns)?":-?\d+,?', b"", line) for line in text.split(b"\n")]
    return lines


@pytest.mark.parametrize("compact", (False, True), ids=("full", "compact"))
def test_the_lane_writes_the_general_paths_lines(tmp_path, compact):
    """Mutation seen to fail this: `CompactRenderer.transition` not updating the lane's `step`
    (the next record of the step gets a second `s`/`q` head)."""
    shape = job_shape_fields(1, 1, 0, 0) if compact else None
    for writer in WRITERS:
        with AuditLog(tmp_path / writer, "run-l", 0, 0, 0, shape=shape) as log:
            _write(log, writer)
    for writer in WRITERS[1:]:
        assert _lines(tmp_path / writer) == _lines(tmp_path / "general"), writer
        records = list(read_records(tmp_path / writer / "rank-0.jsonl"))
        assert [r["seq"] for r in records] == list(range(len(records)))
        assert records[-2]["outcome"] == "refused" and records[-1]["step_id"] is None


def _records(run_dir) -> list[dict]:
    """Every record but the `job` records, segment after segment, without their times and seq
    (each segment's `job` record takes a seq, and where a segment ends depends on the bytes of
    the times)."""
    files = sorted(run_dir.glob("rank-0*.jsonl"), key=lambda p: int(p.name.split(".")[1]) if p.name.count(".") > 1 else 0)
    return [{k: v for k, v in r.items() if k not in ("t_ns", "seq")} for f in files for r in read_records(f)
            if r["event"] != "job"]


def test_the_lane_switches_segments_as_the_general_path_does(tmp_path):
    """A capped log: a full segment waits for its step to end, then the next step starts the
    next segment. The lane hands those writes to the general path and takes them back after:
    whole steps in each segment, seq gapless, the same records. Mutations seen to fail this:
    the method ignoring `lane.open` (writing on into the full segment: no switch happens)."""
    shape = job_shape_fields(1, 1, 0, 0)
    for writer in WRITERS:
        with AuditLog(tmp_path / writer, "run-s", 0, 0, 0, shape=shape, max_log_bytes=64 * MIN_SEGMENT,
                      pinned_steps=1) as log:
            for round_ in range(400):  # ~3 segments' worth
                _write(log, writer, base=13 * round_)
            assert len(log.segments.switches) >= 2, "the run must switch segments"
            assert log.lane.open is True  # the lane is back after the last switch
    plain_records = _records(tmp_path / "general")
    for writer in WRITERS[1:]:
        lane_records = _records(tmp_path / writer)
        assert lane_records[:len(plain_records)] == plain_records[:len(lane_records)], writer
        for f in (tmp_path / writer).glob("rank-0.*.jsonl"):  # each later segment: whole steps, seq gapless
            records = list(read_records(f))
            assert records[1]["event"] == "transition" and records[1]["trigger"] in ("decode", "prefill"), f.name
            assert [r["seq"] for r in records] == list(range(records[0]["seq"], records[0]["seq"] + len(records)))


def test_the_lane_writes_the_general_paths_bytes_across_the_files_growth(tmp_path):
    """Thousands of steps: the file grows by chunks under the short path, as under the general
    one (`MappedFile.write` grows it where a line does not fit)."""
    shape = job_shape_fields(1, 1, 0, 0)
    for writer in WRITERS:
        with AuditLog(tmp_path / writer, "run-g", 0, 0, 0, shape=shape) as log:
            for round_ in range(400):  # ~0.56 MB: two growths of the file
                _write(log, writer, base=13 * round_)
            size = log._file.size
        assert size > 2 * (1 << 18), "the run must grow the file twice"
    for writer in WRITERS[1:]:
        assert _lines(tmp_path / writer) == _lines(tmp_path / "general"), writer
