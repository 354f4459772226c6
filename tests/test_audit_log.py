"""The per-process audit log (DESIGN section 7): file layout, record header, durability, threads."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from runner_fsm.audit import (
    SCHEMA_VERSION,
    AuditLog,
    AuditLogClosedError,
    AuditLogFormatError,
    read_records,
    strip_times,
)

HEADER = ["schema", "run_id", "seq", "t_ns", "dp_rank", "pcp_rank", "event", "step_id"]


def lines_on_disk(path: Path) -> list[str]:
    """The records' lines: a log still open ends in blank lines (see `audit.mapped`)."""
    return [line for line in path.read_text().splitlines() if line.strip()]


def scripted_step(log: AuditLog, step_id: int) -> None:
    """One decode step as the runner would log it; fixed, so two runs must agree."""
    log.transition(step_id, "schedule", "ready", "decode", "ok")
    with log.collective_span(step_id, "dp", "all_reduce", 1, [(7, 2)], pg_seq=step_id):
        pass
    log.buffers(step_id, "refresh", {"input_ids": {"ptr": 4096, "shape": (8,), "version": step_id}})
    log.graph(step_id, "replay", num_tokens=8)
    log.transition(step_id, "finish", "decode", "ready", "ok")


@pytest.fixture
def log(tmp_path):
    with AuditLog(tmp_path / "run", "run-7", global_rank=5, dp_rank=2, pcp_rank=1) as audit:
        yield audit


def test_one_file_per_rank_named_by_global_rank(tmp_path):
    run_dir = tmp_path / "nested" / "run"
    with AuditLog(run_dir, "r", global_rank=3, dp_rank=1, pcp_rank=1) as audit:
        assert audit.path == run_dir / "rank-3.jsonl"
        assert audit.path.exists()


def test_every_line_parses_with_gapless_seq_and_header(log):
    for step in range(3):
        scripted_step(log, step)
    log.fault(3, RuntimeError("peer gone"), "peer gone")

    raw = lines_on_disk(log.path)
    records = [json.loads(line) for line in raw]
    assert len(records) == 3 * 6 + 1
    assert [r["seq"] for r in records] == list(range(len(records)))
    for record in records:
        assert list(record)[: len(HEADER)] == HEADER
        assert record["schema"] == SCHEMA_VERSION
        assert (record["run_id"], record["dp_rank"], record["pcp_rank"]) == ("run-7", 2, 1)
    times = [r["t_ns"] for r in records]
    assert times == sorted(times)
    assert records[-1] | {"t_ns": 0} == {
        "schema": SCHEMA_VERSION, "run_id": "run-7", "seq": 18, "t_ns": 0, "dp_rank": 2, "pcp_rank": 1,
        "event": "fault", "step_id": 3, "error": "RuntimeError", "message": "peer gone",
    }


def test_event_fields(log):
    log.transition(4, "schedule", "ready", "idle_dummy", "ok")
    log.collective(4, "dp", "all_reduce", 1, [[7, 2]], 9, "enqueue")
    log.graph(4, "capture", num_tokens=16)
    first, second, third = (strip_times(r) for r in read_records(log.path))
    assert first["event"] == "transition" and first["step_id"] == 4
    assert {k: first[k] for k in ("trigger", "src", "dst", "outcome")} == {
        "trigger": "schedule", "src": "ready", "dst": "idle_dummy", "outcome": "ok"}
    assert {k: second[k] for k in ("group", "op", "phase", "shapes", "pg_seq", "stage")} == {
        "group": "dp", "op": "all_reduce", "phase": 1, "shapes": [[7, 2]], "pg_seq": 9,
        "stage": "enqueue"}
    assert (third["event"], third["action"], third["num_tokens"]) == ("graph", "capture", 16)


def test_each_record_is_on_disk_before_the_call_returns(log):
    for count in range(1, 6):
        log.transition(count, "schedule", "ready", "prefill", "ok")
        assert len(lines_on_disk(log.path)) == count


def test_enqueue_is_on_disk_while_the_collective_runs(log):
    with log.collective_span(0, "dp", "all_reduce", 1, [(7, 2)], 0):
        inside = [json.loads(line) for line in lines_on_disk(log.path)]
    assert [r["stage"] for r in inside] == ["enqueue"]
    assert [r["stage"] for r in read_records(log.path)] == ["enqueue", "done"]


def test_failed_collective_leaves_a_dangling_enqueue_and_nothing_else(log):
    with pytest.raises(TimeoutError):
        with log.collective_span(3, "dp", "all_reduce", 2, [(7, 2)], 11):
            raise TimeoutError("peer never joined")
    records = list(read_records(log.path))
    assert len(records) == 1
    assert (records[0]["stage"], records[0]["pg_seq"], records[0]["phase"]) == ("enqueue", 11, 2)


def test_numpy_and_torch_values_serialise(log):
    shapes = (np.int64(7), torch.Size([2, 3]), np.array([4, 5]))
    log.collective(np.int64(1), "pcp", "all_gather", None, shapes, np.int32(2), "done")

    @dataclass(frozen=True)
    class Fingerprint:
        ptr: int
        shape: tuple
        version: int

    tensor = torch.zeros(2, 3)
    tensor.add_(1)  # bumps the in-place version counter
    log.buffers(1, "dummy", {
        "slots": Fingerprint(np.int64(64), (np.int64(4),), np.int64(2)),
        "tables": {"ptr": 128, "shape": (2, 8), "version": 0},
        "hidden": tensor,
    })
    collective, buffers = read_records(log.path)
    assert (collective["step_id"], collective["pg_seq"]) == (1, 2)
    assert collective["shapes"] == [7, [2, 3], [4, 5]]
    assert buffers["buffers"] == {
        "slots": {"ptr": 64, "shape": [4], "version": 2},
        "tables": {"ptr": 128, "shape": [2, 8], "version": 0},
        "hidden": {"ptr": tensor.data_ptr(), "shape": [2, 3], "version": 1},
    }


@pytest.mark.parametrize("bad_call", [
    lambda log: log.collective(0, "dp", "all_reduce", 1, [], 0, "started"),
    lambda log: log.graph(0, "rewind"),
    lambda log: log.graph(0, "replay", seq=99),
    lambda log: log.graph(0, "replay", blob=object()),
])
def test_rejected_record_writes_nothing_and_consumes_no_seq(log, bad_call):
    with pytest.raises((ValueError, TypeError)):
        bad_call(log)
    log.transition(0, "schedule", "ready", "decode", "ok")
    assert [r["seq"] for r in read_records(log.path)] == [0]


def test_close_is_idempotent_and_later_writes_fail_clearly(log):
    log.transition(0, "stop", "ready", "stopped", "ok")
    log.close()
    log.close()
    assert log.closed
    with pytest.raises(AuditLogClosedError, match=r"rank-5\.jsonl.*closed"):
        log.fault(1, "X", "too late")
    with pytest.raises(AuditLogClosedError):
        with log.collective_span(1, "dp", "all_reduce", 1, [], 1):
            pytest.fail("body must not run once the enqueue cannot be logged")
    assert len(lines_on_disk(log.path)) == 1


def test_reopening_an_existing_rank_file_refuses_to_clobber_it(tmp_path):
    with AuditLog(tmp_path, "r", 0, 0, 0) as first:
        first.transition(0, "start", "init", "ready", "ok")
    with pytest.raises(FileExistsError, match="fresh run_dir"):
        AuditLog(tmp_path, "r", 0, 0, 0)
    assert len(lines_on_disk(first.path)) == 1


def test_two_logs_in_one_process_do_not_interfere(tmp_path):
    config_before = structlog.get_config()
    a = AuditLog(tmp_path, "run-a", global_rank=0, dp_rank=0, pcp_rank=0)
    b = AuditLog(tmp_path, "run-b", global_rank=1, dp_rank=0, pcp_rank=1)
    for step in range(3):
        a.transition(step, "schedule", "ready", "prefill", "ok")
        b.transition(step, "schedule", "ready", "idle_dummy", "ok")
        b.graph(step, "replay")
    a.close()
    b.transition(3, "stop", "ready", "stopped", "ok")  # b outlives a
    b.close()

    records_a, records_b = list(read_records(a.path)), list(read_records(b.path))
    assert [r["seq"] for r in records_a] == [0, 1, 2]
    assert [r["seq"] for r in records_b] == list(range(7))
    assert {(r["run_id"], r["pcp_rank"]) for r in records_a} == {("run-a", 0)}
    assert {(r["run_id"], r["pcp_rank"]) for r in records_b} == {("run-b", 1)}
    assert structlog.get_config() == config_before


def test_concurrent_writers_keep_seq_gapless_and_lines_whole(log):
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force thread switches mid-record to expose races
    threads_n, per_thread = 8, 300
    barrier = threading.Barrier(threads_n)

    def writer(worker: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            log.collective(i, f"worker-{worker}", "all_gather", 1, [(i, worker)], i, "enqueue")

    try:
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)

    records = list(read_records(log.path))  # raises on any torn or interleaved line
    assert [r["seq"] for r in records] == list(range(threads_n * per_thread))
    for worker in range(threads_n):
        mine = [r["step_id"] for r in records if r["group"] == f"worker-{worker}"]
        assert mine == list(range(per_thread))


def test_same_script_twice_gives_same_file_except_times(tmp_path):
    def run(run_dir: Path) -> Path:
        with AuditLog(run_dir, "golden", global_rank=2, dp_rank=1, pcp_rank=0) as audit:
            audit.transition(None, "capture", "init", "capturing", "ok")
            audit.graph(None, "capture", num_tokens=8)
            audit.transition(None, "captured", "capturing", "ready", "ok")
            for step in range(2):
                scripted_step(audit, step)
            audit.fault(2, ValueError("bad batch"), "bad batch")
        return audit.path

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    stripped = [[json.dumps(strip_times(r)) for r in read_records(p)] for p in (first, second)]
    assert stripped[0] == stripped[1]
    assert len(stripped[0]) == 3 + 2 * 6 + 1
    assert all("t_ns" not in line for line in stripped[0])


def test_strip_times_copies_and_drops_only_time():
    record = {"seq": 1, "t_ns": 5, "event": "graph"}
    assert strip_times(record) == {"seq": 1, "event": "graph"}
    assert record["t_ns"] == 5


@pytest.mark.parametrize("bad_line", ['{"seq": 1', "[1, 2]", '\n{"seq": 2}'])  # the last: blank, then more
def test_reader_names_file_and_line_of_a_bad_record(tmp_path, bad_line):
    path = tmp_path / "rank-0.jsonl"
    path.write_text('{"seq": 0}\n' + bad_line + "\n")
    records = read_records(path)
    assert next(records) == {"seq": 0}
    with pytest.raises(AuditLogFormatError, match=rf"rank-0\.jsonl:2:"):
        next(records)
