"""A capped audit log (`runner_fsm.audit.segments`): segments, the cap, what is never rotated away.

Every test writes a real `AuditLog` with a small cap (the minimum segment, 64 KiB) through
enough steps to rotate many times, and measures the rank's files on disk at every segment
switch itself (not only through the writer's own figures).
"""

from __future__ import annotations

import os
import re

import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.segments import MIN_SEGMENT, SegmentPolicy, parse_bytes
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.testing.logs import files_bytes

CAP = 6 * MIN_SEGMENT


def disk_bytes(run_dir, rank: int = 0) -> int:
    """What the rank's files take now (st_size: an open segment's reserved tail included)."""
    return files_bytes(run_dir).get(rank, 0)


@pytest.fixture
def switches(monkeypatch):
    """The disk the rank's files take right before and right after every segment switch."""
    seen = []
    switch = SegmentPolicy.switch

    def measured(self, first_step, close_current, open_next):
        before = disk_bytes(self.run_dir, self.global_rank)
        switch(self, first_step, close_current, open_next)
        seen.append((first_step, before, disk_bytes(self.run_dir, self.global_rank)))
    monkeypatch.setattr(SegmentPolicy, "switch", measured)
    return seen


def capped_log(run_dir, *, cap=CAP, pinned_steps=50, rank=0) -> AuditLog:
    return AuditLog(run_dir, "run-s", rank, rank, 0, shape=job_shape_fields(2, 1, rank, 0), max_log_bytes=cap,
                    pinned_steps=pinned_steps)


def start(log: AuditLog) -> None:
    log.transition(-1, "capture", "init", "capturing", "ok")
    log.graph(-1, "capture", num_tokens=8)
    log.buffers(-1, "capture", {"seq_lens": {"ptr": 4096, "shape": [8], "version": 1}})
    log.transition(-1, "captured", "capturing", "ready", "ok")


def step(log: AuditLog, step_id: int) -> None:
    """A decode step of the vLLM worker at the full audit, about 400 bytes."""
    log.transition(step_id, "decode", "ready", "decode", "ok")
    log.collective(step_id, "dp", "all_reduce", 1, [[9, 2]], step_id, "enqueue", sent={"num_tokens": 2})
    log.collective(step_id, "dp", "all_reduce", 1, [[9, 2]], step_id, "done", agreed={
        "step_id": step_id, "phase": 1, "num_tokens_across_dp": [2, 1], "graph_mode": 0,
        "uniform_token_count": 0, "num_reqs": 1, "all_idle": False})
    batch = log.batch()
    batch.buffers(step_id, "real", {"seq_lens": {"ptr": 4096, "shape": [8], "version": step_id + 2,
                                                 "digest": 1_000_000_000 + step_id, "rows": 2}})
    batch.transition(step_id, "finish", "decode", "ready", "ok")
    batch.write()


def segment_files(run_dir, rank: int = 0) -> list[tuple[int, str]]:
    mine = re.compile(rf"^rank-{rank}(?:\.(\d+))?\.jsonl$")
    return sorted((int(m[1] or 0), name) for name in os.listdir(run_dir) if (m := mine.match(name)))


def test_a_capped_log_never_exceeds_its_cap_at_any_switch(tmp_path, switches):
    """Mutation: `_make_room` leaving out the next segment's reserve -> over the cap."""
    with capped_log(tmp_path) as log:
        start(log)
        for s in range(6000):
            step(log, s)
    assert len(switches) >= 20, "the run must rotate many times"
    assert max(before for _, before, _ in switches) <= CAP
    assert max(after for _, _, after in switches) <= CAP
    assert disk_bytes(tmp_path) <= CAP
    # the writer's own figures agree with the disk, and the newest segment's job record says so
    assert log.segments.peak == max(before for _, before, _ in switches)
    newest = next(read_records(log.current_path))
    assert newest["disk_peak"] == log.segments.peak and newest["disk_bytes"] <= CAP


def test_each_segment_begins_with_the_job_record_and_its_first_step(tmp_path, switches):
    """Mutation: the job record of a new segment without `first_step` -> fails."""
    with capped_log(tmp_path) as log:
        start(log)
        for s in range(3000):
            step(log, s)
    files = segment_files(tmp_path)
    assert files[0] == (0, "rank-0.jsonl") and len(files) > 2
    seqs = []
    for index, name in files:
        records = list(read_records(tmp_path / name))
        job = records[0]
        assert job["event"] == "job" and job["segment"] == index and job["max_log_bytes"] == CAP
        assert job["run_id"] == "run-s" and job["global_rank"] == 0
        if index > 0:
            steps = [r["step_id"] for r in records[1:]]
            assert steps[0] == job["first_step"] and records[1]["trigger"] == "decode", "whole steps only"
            assert steps == sorted(steps)
        seqs.append([r["seq"] for r in records])
    for seq in seqs:  # gapless in each file, and on from where the previous kept file ended
        assert seq == list(range(seq[0], seq[0] + len(seq)))
    # segment 0 keeps its head: the job record and the start-up records (graph captures)
    head = list(read_records(tmp_path / "rank-0.jsonl"))
    assert [r["event"] for r in head] == ["job", "transition", "graph", "buffers", "transition"]
    assert {f"{name}.idx" for index, name in files[1:-1]} <= set(os.listdir(tmp_path))


def test_writes_cost_nothing_more_for_the_cap_between_switches(tmp_path):
    """The check rides on the file's growth: between switches the log writes through the
    plain write path, with no per-write test. Mutation: leaving the watching path installed
    after a switch -> fails."""
    with capped_log(tmp_path) as log:
        start(log)
        assert "_write_all" not in vars(log)
        for s in range(1500):
            step(log, s)
        assert log.segments.switches, "the run must switch segments"
        assert "_write_all" not in vars(log)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fault_and_the_steps_before_it_are_never_rotated_away(tmp_path, switches, rank):
    """Mutation: `_pinned` ignoring pins -> the fault's segment is deleted."""
    fault_step = 700
    with capped_log(tmp_path, rank=rank, pinned_steps=100) as log:
        start(log)
        for s in range(6000):
            step(log, s)
            if s == fault_step:
                log.fault(s, "BatchError", "rejected")
    kept = [r for _, name in segment_files(tmp_path, rank) for r in read_records(tmp_path / name)]
    steps = {r["step_id"] for r in kept if isinstance(r["step_id"], int)}
    assert any(r["event"] == "fault" and r["step_id"] == fault_step for r in kept)
    assert set(range(fault_step - 100, fault_step + 1)) <= steps
    assert 3000 not in steps, "unpinned steps in between are rotated away"
    assert max(before for _, before, _ in switches) <= CAP


def test_pins_that_leave_no_room_drop_the_newest_unpinned_data_and_say_so(tmp_path, switches):
    """Pins everywhere: the cap holds, the pinned segments stay, and a `job` record lists the
    steps dropped for them. Mutation: `_victim` returning None once only pins are left ->
    over the cap."""
    with capped_log(tmp_path, pinned_steps=10) as log:
        start(log)
        for s in range(4000):
            step(log, s)
            if s in (300, 600, 900, 1200):
                log.pin(s)
    kept = [r for _, name in segment_files(tmp_path) for r in read_records(tmp_path / name)]
    steps = {r["step_id"] for r in kept if isinstance(r["step_id"], int)}
    assert {300, 600, 900, 1200} <= steps
    dropped = [span for r in kept if r["event"] == "job" for span in r.get("dropped", ())]
    assert dropped and all(first <= last for first, last in dropped)
    assert max(before for _, before, _ in switches) <= CAP


def test_companions_rotate_and_go_with_their_segment(tmp_path, switches):
    """The vLLM step journal's segments follow the log's and count against the cap, as does a
    Flight Recorder dump. Mutation: `_delete` keeping companion files -> over the cap."""
    from runner_fsm.integrations.vllm.recording.journal import Journal, read_journal

    (tmp_path / "fr-rank-0.json").write_bytes(b"x" * MIN_SEGMENT)
    with capped_log(tmp_path) as log:
        journal = Journal(str(tmp_path), 0)
        log.add_companion(journal)
        start(log)
        for s in range(5000):
            step(log, s)
            journal.write({"step": s, "sched": [1, 1], "sampled": [[s % 97], [s % 89]]})
        journal.close()
    logs = {index for index, _ in segment_files(tmp_path)}
    journals = {int(m[1] or 0) for name in os.listdir(tmp_path) if (m := re.match(r"^vllm-steps-0(?:\.(\d+))?\.jsonl$", name))}
    assert journals - {0} == logs - {0} and len(logs) > 2
    entries = read_journal(str(tmp_path), 0)
    assert entries[-1]["step"] == 4999 and [e["step"] for e in entries] == sorted(e["step"] for e in entries)
    assert max(before for _, before, _ in switches) <= CAP


class Grower:
    """A companion that takes more bytes a step than the log beside it (the vLLM journal of
    issue 53 did: 343 B a step against 220), written straight to disk."""

    def __init__(self, run_dir, per_step: int):
        self.run_dir, self.per_step = run_dir, per_step
        self.file = open(self.segment_path(0), "xb", buffering=0)

    def segment_path(self, index: int):
        return self.run_dir / ("grower-0.jsonl" if index == 0 else f"grower-0.{index}.jsonl")

    def size(self) -> int:
        return self.file.tell()

    def rotate(self, index: int) -> None:
        self.file.close()
        self.file = open(self.segment_path(index), "xb", buffering=0)

    def step(self, s: int) -> None:
        self.file.write(b"%d " % s + b"x" * (self.per_step - 2 - len(str(s))) + b"\n")


def test_a_64_kib_cap_rotates_and_holds_with_a_companion_larger_than_the_log(tmp_path, switches):
    """Issue 53: at a 64 KiB cap the segment is a quarter of it, and it fills with its log and
    its companion together, so a companion growing faster than the log still rotates with it and
    the rank's files (log, indexes, companion, a Flight Recorder dump at its share) hold the cap
    at every step. Fails on 778913f: one 64 KiB segment of log alone (the sum reached ~2x)."""
    cap = 64 << 10
    grower = Grower(tmp_path, per_step=600)
    files = lambda: sum(os.stat(tmp_path / n).st_size for n in os.listdir(tmp_path))  # noqa: E731
    with capped_log(tmp_path, cap=cap, pinned_steps=20) as log:
        log.add_companion(grower)
        start(log)
        seen = []
        for s in range(3000):
            if s in (0, 1500):  # the dump, rewritten whole, up to its share of the cap (an eighth)
                (tmp_path / "fr-rank-0.json").write_bytes(b"d" * (cap // 8 if s else cap // 16))
            step(log, s)
            grower.step(s)
            seen.append(files())
        grower.file.close()
    assert max(seen) <= cap and max(before for _, before, _ in switches) <= cap, (max(seen), switches[-3:])
    assert log.segments.segment_bytes == cap // 4 and len(switches) > 50, len(switches)
    kept = [r for index, name in segment_files(tmp_path) for r in read_records(tmp_path / name)]
    assert kept[-1]["step_id"] == 2999 and not [r for r in kept if r["event"] == "job" and "over_cap" in r]


def test_pins_are_all_that_exceeds_the_cap_and_the_job_record_says_by_how_much(tmp_path, switches):
    """Every segment pinned (a pin every 40 steps, 200 steps kept before each): nothing may go,
    the files grow past a 64 KiB cap, and each next segment's `job` record says by how much
    (`over_cap`) and how full they were (`disk_peak`). Mutation: `job_fields` leaving out
    `over_cap` -> the excess unrecorded."""
    cap = 64 << 10
    with capped_log(tmp_path, cap=cap, pinned_steps=200) as log:
        start(log)
        for s in range(1200):
            step(log, s)
            if s % 40 == 0:
                log.pin(s)
    jobs = [r for _, name in segment_files(tmp_path) for r in read_records(tmp_path / name) if r["event"] == "job"]
    over = [job for job in jobs if "over_cap" in job]
    assert disk_bytes(tmp_path) > cap and over, [(j.get("segment"), j.get("disk_bytes")) for j in jobs]
    newest = jobs[-1]
    assert newest["over_cap"] > 0 and newest["disk_peak"] > cap
    assert newest["over_cap"] >= newest["disk_bytes"] - cap  # at least what the kept files exceed it by


@pytest.mark.parametrize("text, value", [("2G", 2 << 30), ("512M", 512 << 20), ("64KiB", 64 << 10),
                                         ("1048576", 1 << 20), ("0", None), (None, None)])
def test_byte_counts(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["-1", "2X", "lots"])
def test_byte_counts_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_a_closed_segments_step_index_points_at_its_steps(tmp_path):
    """Each entry's offset and line number are where its step begins, and a seek through the
    index lands where reading the segment from its start would. Mutation: counting the line
    numbers from the previous entry's line instead of its newline (`stepindex.build`) -> off."""
    from runner_fsm.audit import stepindex
    from runner_fsm.audit.seek import locate

    with capped_log(tmp_path) as log:
        start(log)
        for s in range(3000):
            step(log, s)
    closed = tmp_path / segment_files(tmp_path)[1][1]
    index = stepindex.read(closed)
    assert index is not None and len(index.entries) > 3
    data = closed.read_bytes()
    lines = data.splitlines(keepends=True)
    starts = {}  # step -> (offset, line number) of its first record, read from the start
    offset = 0
    for number, line in enumerate(lines, 1):
        if line.startswith(b'{"s":'):
            starts.setdefault(int(line[5:line.index(b",")]), (offset, number))
        offset += len(line)
    for step_id, at, number in index.entries:
        assert starts[step_id] == (at, number)
    assert (index.first_step, index.last_step, index.size) == (min(starts), max(starts), len(data))
    for step_id in (index.first_step, index.first_step + 17, (index.first_step + index.last_step) // 2, index.last_step):
        assert locate(closed, step_id, compact=True) == starts[step_id]


def test_a_segment_rotated_away_while_it_is_compressed_stays_away(tmp_path):
    """The writer's thread compresses a closed segment while rotation deletes it (both in the
    writer's process, the deletion under the compressor's lock): the compressed form, finished
    after the deletion, must not bring the segment (or its step index) back as a kept one.
    Seen before the lock: a rotated segment came back, and replay found a replica missing from
    its steps. Mutation seen to fail this: `compress` putting its output in place without
    checking that the segment is still there."""
    import threading

    from runner_fsm.audit import compress as gz
    from runner_fsm.audit.stepindex import index_path

    path = tmp_path / "rank-0.3.jsonl"
    path.write_bytes(b"".join(b'{"s":%d,"q":%d,"t":5,"tr":"decode"}\n' % (i, i) for i in range(5000)))
    lock = threading.Lock()
    result = []
    with lock:  # the rotation: the compressor waits for it to put its output in place
        worker = threading.Thread(target=lambda: result.append(gz.compress(path, lock)))
        worker.start()
        while not (tmp_path / "rank-0.3.jsonl.gz.tmp").exists() or worker.is_alive() and \
                (tmp_path / "rank-0.3.jsonl.gz.tmp").stat().st_size == 0:
            pass
        for stale in (path, index_path(path)):
            stale.unlink(missing_ok=True)
    worker.join(timeout=30)
    assert result == [None]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
