"""The audit log's memory-mapped file: records on disk when the call returns, a blank tail while
open (and after a process died without closing), the exact bytes once closed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner_fsm.audit import AuditLog, read_records, step_lane
from runner_fsm.audit.mapped import CHUNK, MappedFile, data_end, is_blank
from runner_fsm.replay.judge import replay


def test_written_bytes_are_in_the_file_before_close_then_exactly_them(tmp_path):
    path = tmp_path / "f.jsonl"
    out = MappedFile(path)
    out.write(b'{"a":1}\n')
    out.write(b'{"b":2}\n')
    seen = path.read_bytes()  # another reader, while the file is open
    assert seen.startswith(b'{"a":1}\n{"b":2}\n')
    assert len(seen) == CHUNK and not seen[16:].strip()  # the rest of the chunk: blank lines
    assert data_end(path) == 16
    out.close()
    assert path.read_bytes() == b'{"a":1}\n{"b":2}\n'
    assert data_end(path) == 16
    out.close()  # idempotent


def test_writes_across_chunks_keep_every_byte(tmp_path):
    path = tmp_path / "f.jsonl"
    lines = [b'{"i":%d,"pad":"%s"}\n' % (i, b"x" * (i % 500)) for i in range(3000)]  # ~0.8 MB
    out = MappedFile(path)
    for line in lines:
        out.write(line)
    out.write(b"y" * (2 * CHUNK) + b"\n")  # one write larger than a chunk
    expected = b"".join(lines) + b"y" * (2 * CHUNK) + b"\n"
    assert path.read_bytes()[:len(expected)] == expected
    assert data_end(path) == len(expected)
    out.close()
    assert path.read_bytes() == expected


def test_exclusive_create_and_no_write_after_close(tmp_path):
    path = tmp_path / "f.jsonl"
    out = MappedFile(path)
    with pytest.raises(FileExistsError):
        MappedFile(path)
    out.close()
    with pytest.raises(ValueError, match="closed"):
        out.write(b"x" * (CHUNK + 1))


def test_data_end_of_files_without_a_blank_tail(tmp_path):
    path = tmp_path / "f.jsonl"
    for data, end in ((b"", 0), (b"\n\n", 0), (b'{"a":1}\n', 8), (b'{"a":1}\n{"b', 11), (b'{"a":1}\n\n\n', 8)):
        path.write_bytes(data)
        assert data_end(path) == end, data
    assert is_blank(b"\n") and is_blank(b"") and not is_blank(b"{}\n")


def test_a_log_whose_process_died_keeps_its_records_and_replays(tmp_path):
    """The process ends without closing its log (`os._exit`): the records are on disk, the
    blank tail is skipped by every reader, and replay names where the replica stopped."""
    script = f"""
import os
from runner_fsm.audit import AuditLog
log = AuditLog({str(tmp_path)!r}, "died", 0, 0, 0)
log.transition(-1, "capture", "init", "capturing", "ok")
log.transition(-1, "captured", "capturing", "ready", "ok")
log.transition(0, "decode", "ready", "decode", "ok")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    path = tmp_path / "rank-0.jsonl"
    assert os.path.getsize(path) == CHUNK  # never cut: the blank tail is there
    assert [r["trigger"] for r in read_records(path)] == ["capture", "captured", "decode"]
    report = replay(tmp_path)
    assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("unfinished", 0, 0)]


def test_an_audit_log_closed_normally_has_no_blank_tail(tmp_path):
    with AuditLog(tmp_path, "r", 0, 0, 0) as log:
        log.transition(0, "decode", "ready", "decode", "ok")
    data = log.path.read_bytes()
    assert data.count(b"\n") == 1 and data.endswith(b"}\n")


def test_a_forked_child_closing_its_copy_does_not_cut_the_parents_file(tmp_path):
    path = tmp_path / "f.jsonl"
    out = MappedFile(path)
    out.write(b'{"a":1}\n')
    pid = os.fork()
    if pid == 0:  # the child: closes its inherited copy, then leaves without cleanup
        out.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    out.write(b'{"b":2}\n')  # would raise SIGBUS past a cut file
    assert os.path.getsize(path) == CHUNK
    out.close()
    assert path.read_bytes() == b'{"a":1}\n{"b":2}\n'


def test_a_dead_ranks_last_step_is_read_past_the_blank_tail(tmp_path):
    """The engine names where a dead rank's log ends (`engine.api`): its last record, not a blank line."""
    from runner_fsm.engine.api import _last_logged_step

    log = AuditLog(tmp_path, "died", 3, 1, 1)
    log.transition(6, "decode", "ready", "decode", "ok")
    log.transition(7, "decode", "ready", "decode", "ok")
    assert os.path.getsize(log.path) == CHUNK  # not closed: the process "died" here
    assert _last_logged_step(str(tmp_path), 3) == 7
    log.close()


def _died_with_a_tail(tmp_path, tail: bytes) -> Path:
    """A log of a rank that died mid-step (decode at step 2) with `tail` after its records."""
    with AuditLog(tmp_path, "died", 0, 0, 0) as log:
        log.transition(-1, "capture", "init", "capturing", "ok")
        log.transition(-1, "captured", "capturing", "ready", "ok")
        for step in range(3):
            log.transition(step, "decode", "ready", "decode", "ok")
            if step < 2:
                log.transition(step, "finish", "decode", "ready", "ok")
    with open(log.path, "ab") as out:
        out.write(tail)
    return log.path


@pytest.mark.parametrize("tail", [b"\n" * 5000, b"\x00" * 70000, b"\x00" * 4096 + b"\n" * 9000])
def test_a_tail_of_fill_or_zeros_ends_the_log_for_every_reader(tmp_path, tail):
    """Zeros where the newline fill never reached the disk (a machine crash) are a blank tail too."""
    path = _died_with_a_tail(tmp_path, tail)
    assert data_end(path) == os.path.getsize(path) - len(tail)
    assert [r["step_id"] for r in read_records(path)] == [-1, -1, 0, 0, 1, 1, 2]
    for jobs in (1, 2):  # one pass, and ranges of steps seeking into the file
        report = replay(tmp_path, jobs=jobs)
        assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("unfinished", 0, 2)], jobs


def test_a_blank_line_inside_the_log_is_a_gap_not_its_end(tmp_path):
    path = _died_with_a_tail(tmp_path, b"")
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + b"\n" + b"".join(lines[3:]))  # a blank line after seq 2
    kinds = [(v.kind, v.step) for v in replay(tmp_path).verdicts]
    assert ("gap", 0) in kinds and ("unfinished", 2) in kinds


def test_writes_across_growths_leave_the_bytes_written(tmp_path):
    """`write` puts each line at the end of what was written (`_size - lane.room`), growing the
    file where a line does not fit: the bytes written, in the open file's data end and once
    closed; closed, `room` is 0 and a write raises. Mutation seen to fail this: `write` not
    taking `room` down (the next line lands on the last)."""
    lane = step_lane.LaneState()
    lines = [b'{"i":%d,"pad":"%s"}\n' % (i, b"x" * (i % 300)) for i in range(2500)]  # ~0.4 MB: two growths
    file = MappedFile(tmp_path / "f.jsonl", lane=lane)
    for line in lines:
        file.write(line)
    expected = b"".join(lines)
    assert file.size == len(expected) and file.room == file._size - len(expected)
    assert data_end(tmp_path / "f.jsonl") == len(expected)
    file.close()
    assert (tmp_path / "f.jsonl").read_bytes() == expected
    assert file.room == 0
    with pytest.raises(ValueError, match="closed"):
        file.write(b"{}\n")
