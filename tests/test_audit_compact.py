"""The compact encoding on disk (`runner_fsm.audit.compact`): fewer bytes, the same records.

A log written with the job's shape is compact; one written without it is in full, as schema 2
first was. The same calls must read back (`read_records`) as the same records from both, and
replay must reach the same verdicts on both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from runner_fsm.audit import AuditLog, read_records, strip_times
from runner_fsm.audit.compact import FORMAT, FORMAT_FIELD
from runner_fsm.audit.render import BuffersTemplate
from runner_fsm.replay.judge import replay
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.testing.synth import DEFECTS, Defect, SynthSpec, write_run

SENT = {"step_id": 3, "phase": 1, "status": 0, "num_tokens": 5, "graph_mode": 2, "uniform_token_count": 1,
        "num_reqs": 2}
AGREED = {"step_id": 3, "phase": 1, "num_tokens_across_dp": [5, 8], "graph_mode": 2, "uniform_token_count": 1,
          "num_reqs": 2, "all_idle": False}
IDENTITY = {"step": 3, "dummy": False, "rows": 5, "digest": 99}


def every_kind_of_record(log: AuditLog) -> None:
    """What the writers write, and the cases the encoding treats apart."""
    log.transition(-1, "capture", "init", "capturing", "ok")
    log.graph(-1, "capture", num_tokens=8, backend="static")
    log.buffers(-1, "capture", {"a": {"ptr": 4096, "shape": [64], "version": 1},
                                "b": {"ptr": 1024, "shape": [8, 4], "version": 1}})
    log.transition(-1, "captured", "capturing", "ready", "ok")
    log.transition(3, "decode", "ready", "decode", "ok")  # chains on, as the table says: trigger alone
    log.collective(3, "dp", "all_reduce", 1, [[7, 2]], 12, "enqueue", sent=dict(SENT),
                   inputs={"decode": 5, "prefill": [9], "pcp": 2, "chunking": "ceil"})
    log.collective(3, "dp", "all_reduce", 1, [[7, 2]], 12, "done", agreed=dict(AGREED))
    # another step and phase than the record's, a sent that is not a LocalDispatch
    log.collective(3, "dp", "all_reduce", 2, [[7, 2]], 13, "enqueue", sent={**SENT, "step_id": 4},
                   inputs={"decode": 5, "prefill": [], "pcp": 2, "chunking": "mrv2", "decodes": [2, 3]})
    log.collective(3, "dp", "all_reduce", 2, [[7, 2]], 13, "done", agreed={**AGREED, "phase": 3, "all_idle": True})
    log.collective(3, "dp", "all_reduce", 2, [[9, 2]], 14, "enqueue", sent={"num_tokens": 4, "vllm": [4, 4, 0, 0]},
                   inputs={"prefill": [4]})  # not the dispatch inputs' fields: as it is
    log.collective(3, "dp", "all_reduce", 2, [[9, 2]], 15, "done")  # closes no enqueue: said in full
    log.buffers(3, "real", {"a": {"ptr": 4096, "shape": [64], "version": 7, "digest": -5},
                            "b": {"ptr": 1024, "shape": [8, 4], "version": 7, "digest": 2**63 - 1}})
    log.collective(3, "expert", "forward", 1, [[5]], 3, "enqueue", rows=5, ctx=dict(IDENTITY), batch=dict(IDENTITY))
    log.buffers(3, "replay", {"a": {"ptr": 4096, "shape": [64], "version": 7, "digest": -5},
                              "b": {"ptr": 1024, "shape": [8, 4], "version": 7, "digest": 2**63 - 1}})
    log.graph(3, "replay", num_tokens=8, dummy=False)
    log.collective(3, "expert", "forward", 1, None, 3, "done", exchange_bytes=10)
    log.buffers(3, "dummy", {"a": {"ptr": 4096, "shape": [64], "version": 8, "rows": 3},
                             "b": {"ptr": 1024, "shape": [8, 4], "version": 9, "digest": 7, "rows": 0}})
    log.collective(3, "expert", "forward", 1, [[5]], 4, "enqueue", ctx={**IDENTITY, "rows": 6},
                   batch={**IDENTITY, "step": 2})
    log.transition(3, "finish", "decode", "ready", "ok")
    log.transition(4, "prefill", "decode", "prefill", "ok")  # does not chain on: in full
    log.transition(4, "decode", "prefill", "prefill", "refused")
    log._emit("stop", 4, {"reason": "SIGTERM"})  # an event the encoding does not know
    log.fault(None, RuntimeError("peer gone"), "peer gone")
    log.collective(np.int64(5), "pcp", "all_gather", 0, (np.int64(7),), np.int32(2), "enqueue",
                   output={"digest": 12, "tokens": 3})
    log.rendered("transition", 5, b'{"tr":["finish","prefill","ready"]}')
    log.rendered("buffers", 5, BuffersTemplate(("a", "b")).body("real", (4096, 64, 10, 11, 2, 1024, 8, 10, 12, 2)))


def test_a_compact_log_reads_back_as_the_same_records_in_full(tmp_path):
    """Mutation: `_unlist` zips `sn` onto the agreed field order (or `ctx` "=" is not expanded,
    or a short transition takes the wrong src) -> the records differ."""
    with AuditLog(tmp_path / "full", "run-c", 1, 1, 0) as full:
        every_kind_of_record(full)
    shape = job_shape_fields(2, 1, 1, 0, buffer_names=["a", "b"])  # what its buffers records list
    with AuditLog(tmp_path / "compact", "run-c", 1, 1, 0, shape=shape) as compact:
        every_kind_of_record(compact)
    written = [strip_times(r) for r in read_records(full.path)]
    read = [strip_times(r) for r in read_records(compact.path)]
    assert read[0]["event"] == "job" and read[0][FORMAT_FIELD] == FORMAT
    read = [{**r, "seq": r["seq"] - 1} for r in read[1:]]  # the job record is seq 0 there
    # The one difference allowed: a done's shapes are its enqueue's.
    written[15]["shapes"] = [[5]]
    assert read == written
    assert len(written) == 26


def test_a_log_in_full_converts_a_compact_body_once_and_writes_it_alike(tmp_path):
    """A log in full keeps each compact body's conversion (`records.plain_lines`: 4.5 us a
    transition otherwise): the same body, written again, reads back as the same record, and a
    body under another event is still refused. Mutations seen to fail this: the conversion
    kept under the body alone (the graph record below is written); the kept body returned for
    another body (the records differ)."""
    body = b'{"tr":["finish","prefill","ready"]}'
    with AuditLog(tmp_path, "run-c", 0, 0, 0) as log:
        for step in (1, 2, 3):
            log.transition(step, "decode", "ready", "decode", "ok")
            log.rendered("transition", step, body)
        log.transition(4, "prefill", "ready", "prefill", "refused")
        with pytest.raises(ValueError, match="holds a transition body"):
            log.rendered("graph", 4, body)
    records = [strip_times(r) for r in read_records(log.path)]
    assert [(r["step_id"], r["trigger"], r["src"], r["dst"], r["outcome"]) for r in records] == [
        (step, *edge) for step in (1, 2, 3) for edge in (("decode", "ready", "decode", "ok"),
                                                          ("finish", "prefill", "ready", "ok"))
    ] + [(4, "prefill", "ready", "prefill", "refused")]


def test_a_log_of_the_writer_before_reads_back_alike(tmp_path):
    """A forward's `ctx` and `batch` are lists now ([dummy, rows, digest(, step)]) and the
    dispatch inputs' chunking a number; the writer before wrote each identity as a dict less its
    `step` where that was the record's, and the chunking by name: both read back as the same
    records. Mutation seen to fail this: the reader taking the list's last element for the
    digest (or dropping the dict branch, or leaving a chunking number as it is) -> they differ."""
    shape = job_shape_fields(2, 1, 1, 0, buffer_names=["a", "b"])
    with AuditLog(tmp_path / "now", "run-c", 1, 1, 0, shape=shape) as log:
        every_kind_of_record(log)
    lines = log.path.read_bytes().splitlines()
    earlier, changed = [lines[0]], []
    for line in lines[1:]:
        record = json.loads(line)
        for name in ("ctx", "batch"):
            value = record.get(name)
            if isinstance(value, list):  # as the writer before wrote it
                changed.append(name)
                record[name] = {"dummy": bool(value[0]), "rows": value[1], "digest": value[2],
                                **({"step": value[3]} if len(value) > 3 else {})}
        if isinstance(record.get("in"), list) and isinstance(record["in"][3], int):
            changed.append(record["in"][3])
            record["in"][3] = ("ceil", "balanced", "mrv2")[record["in"][3]]
        earlier.append(json.dumps(record, separators=(",", ":")).encode())
    assert changed == [0, 2, "batch", "ctx", "batch"]  # ceil, mrv2; two batches, a ctx not its batch's
    old = tmp_path / "earlier" / "rank-0.jsonl"
    old.parent.mkdir()
    old.write_bytes(b"\n".join(earlier) + b"\n")
    assert list(read_records(old)) == list(read_records(log.path))


def test_a_graph_replay_of_its_forwards_rows_says_its_size_once(tmp_path):
    """The embedded engine's graph replay runs the rows its forward's record holds: its
    `num_tokens` is left out on disk and read back from the forward; any other size, or a
    replay with more to say, is written as it is (and so are all of an earlier writer). Mutation seen to fail this: the reader
    filling `num_tokens` from the last forward even when the record has its own -> 8 reads as 4."""
    with AuditLog(tmp_path, "run-c", 1, 1, 0, shape=job_shape_fields(2, 1, 1, 0)) as log:
        for step, size, extra in ((3, 4, {}), (4, 8, {}), (5, 4, {"dummy": True})):
            log.collective(step, "expert", "forward", 1, [[4]], step, "enqueue")
            log.graph(step, "replay", num_tokens=size, **extra)
            log.collective(step, "expert", "forward", 1, [[4]], step, "done")
    lines = [json.loads(line) for line in log.path.read_bytes().splitlines()]
    graphs = [line for line in lines if "g" in line]
    assert [g.get("num_tokens") for g in graphs] == [None, 8, 4]
    read = [r for r in read_records(log.path) if r["event"] == "graph"]
    assert [(r["step_id"], r["num_tokens"], r.get("dummy")) for r in read] == [(3, 4, None), (4, 8, None), (5, 4, True)]


def test_only_the_job_record_carries_the_header(tmp_path):
    """Mutation: the compact renderer writing `run_id` in every record -> fails."""
    with AuditLog(tmp_path, "run-c", 1, 1, 0, shape=job_shape_fields(2, 1, 1, 0)) as log:
        every_kind_of_record(log)
    lines = [json.loads(line) for line in log.path.read_bytes().splitlines()]
    assert lines[0]["event"] == "job" and lines[0]["run_id"] == "run-c" and lines[0]["seq"] == 0
    for line in lines[1:]:
        assert not line.keys() & {"schema", "run_id", "dp_rank", "pcp_rank", "event", "step_id"}, line
    starts = [line for line in lines[1:] if "s" in line]  # a step's first record: step, seq, time
    assert [(line["s"], line["q"]) for line in starts] == [(-1, 1), (3, 5), (4, 20), (None, 23), (5, 24)]
    assert all(set(line) >= {"s", "q", "t"} for line in starts)


def test_bytes_a_step_takes(tmp_path):
    """A DP=2 vLLM decode step at audit=transitions in under 300 bytes (the budget of issue 34,
    which leaves room for Part 20's digest). Mutation: writing `src`/`dst` on a transition
    that chains on -> over budget."""
    with AuditLog(tmp_path, "vllm-20261202-063224-30048", 0, 0, 0, shape=job_shape_fields(2, 1, 0, 0)) as log:
        for step in range(123456, 123466):
            log.rendered("transition", step, b'{"tr":["decode","ready","decode"]}')
            log.collective(step, "dp", "all_reduce", 1, [[9, 2]], 1234567, "enqueue", sent={"num_tokens": 2})
            log.collective(step, "dp", "all_reduce", 1, [[9, 2]], 1234567, "done", agreed={
                "step_id": step, "phase": 1, "num_tokens_across_dp": [2, 1], "graph_mode": 0,
                "uniform_token_count": 0, "num_reqs": 1, "all_idle": False})
            log.collective(step, "expert", "forward", 1, [[2]], 1234567, "enqueue")
            log.collective(step, "expert", "forward", 1, None, 1234567, "done")
            log.rendered("transition", step, b'{"tr":["finish","decode","ready"]}')
    lines = log.path.read_bytes().splitlines()[1:]
    per_step = sum(len(line) + 1 for line in lines[-12:]) / 2
    assert per_step < 270, per_step


@pytest.mark.parametrize("kind", DEFECTS)
def test_replay_judges_compact_logs_as_logs_in_full(tmp_path, kind):
    """Every defect of the synthetic runs, on replica 0 and on the last replica: the same
    verdicts from a compact log as from the same log in full (a lost record's seq, and a cut
    line's length, are the encoding's own). Mutation: the expander not restoring `agreed`'s
    step_id -> agreed_mismatch everywhere."""
    for replica in (0, 2):
        found = []
        for compact in (False, True):
            run = write_run(tmp_path / f"{replica}-{compact}", SynthSpec(dp_size=3, pcp_size=2, steps=14,
                                                                         compact=compact), [Defect(kind, replica, 7)])
            found.append([(v.kind, v.replica, v.step, v.ranks) for v in replay(run).verdicts])
        assert found[0] == found[1]
        assert (kind in ("gap", "truncated")) or any(v[1] == replica for v in found[0]) or not found[0]


def test_a_window_seeks_into_a_compact_log_as_into_one_in_full(tmp_path):
    """Mutation: `seek._step_of` reading only `step_id` -> the window starts at the log's start."""
    reports = []
    for compact in (False, True):
        run = write_run(tmp_path / str(compact), SynthSpec(dp_size=2, pcp_size=2, steps=400, compact=compact),
                        [Defect("agreed_mismatch", 1, 350), Defect("collective_mismatch", 0, 50)])
        reports.append(replay(run, steps=(300, 399)))
    plain, compact = reports
    assert [(v.kind, v.replica, v.step) for v in compact.verdicts] == [("agreed_mismatch", 1, 350)]
    assert [(v.kind, v.replica, v.step, v.line) for v in compact.verdicts] != [] and \
        [(v.kind, v.step) for v in plain.verdicts] == [(v.kind, v.step) for v in compact.verdicts]
    assert compact.summary.records < plain.summary.records * 1.1


def _without_times(path) -> list[bytes]:
    import re

    return [re.sub(rb'"t(_ns)?":\d+,', b"", line) for line in path.read_bytes().splitlines()]


def test_buffer_fingerprints_write_the_bytes_of_their_fields(tmp_path):
    """The embedded engine's buffers (BufferFingerprints, `render.Fingerprints`) are written from
    the tuples: the same bytes as their fields (`fingerprint_fields`) handed over as dicts, in
    full and compact, "=" across both kinds; and a `sent`, `inputs` or identity with as many keys
    as its fields but another one is kept as it is. Mutations seen to fail this: a shared version
    left in each entry; the digest written where it is None; "=" only between two of one kind."""
    from runner_fsm.audit.render import fingerprint_fields
    from runner_fsm.pcp.fingerprint import BufferFingerprint as FP

    steps = [{"a": FP(4096, (64,), 7, 5), "b": FP(1024, (8, 4), 7, None)},  # shared version
             {"a": FP(4096, (64,), 7, 5), "b": FP(1024, (8, 4), 8, 0)},  # versions differ
             {"b": FP(1024, (8, 4), 8, 0), "a": FP(4096, (64,), 7, 5)},  # not in the job's order
             {"a": FP(4096, (64,), 7, 5)}]  # one buffer: as fields

    def write(log, as_fields: bool) -> None:
        for step, fps in enumerate(steps):
            given = [{name: fingerprint_fields(fp) for name, fp in fps.items()} if as_fields else fps] * 2
            log.buffers(step, "real", given[0])
            log.buffers(step, "replay", {name: fingerprint_fields(fp) for name, fp in fps.items()})  # "="
            log.buffers(step, "replay", given[1])  # "=" again
        log.collective(9, "dp", "all_reduce", 1, [[7, 2]], 1, "enqueue",
                       sent={**{k: v for k, v in SENT.items() if k != "status"}, "vllm": 1},
                       inputs={"decode": 5, "prefill": [9], "pcp": 2, "decodes": "ceil"})
        log.collective(9, "expert", "forward", 1, [[5]], 3, "enqueue", ctx={"step": 9, "dummy": False, "rows": 5,
                                                                            "other": 1}, batch=dict(IDENTITY))

    for shape in (None, job_shape_fields(1, 1, 0, 0, buffer_names=["a", "b"])):
        paths = []
        for as_fields in (True, False):
            with AuditLog(tmp_path / f"{shape is None}-{as_fields}", "run-f", 0, 0, 0, shape=shape) as log:
                write(log, as_fields)
            paths.append(log.path)
        fields, tuples = (_without_times(path) for path in paths)
        assert fields == tuples and len(tuples) == 14 + (shape is not None)
        if shape is not None:
            assert tuples[2].endswith(b'"buf":"="}') and tuples[3].endswith(b'"buf":"="}')
            assert tuples[1].endswith(b'"buf":[[3072,[64],5],[0,[8,4]]],"p0":1024,"v":7}')
            assert b'"sent":{' in tuples[13] and b'"inputs":{' in tuples[13] and b'"ctx":{' in tuples[14]
