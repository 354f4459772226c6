"""Per-process audit log: JSON Lines at `<run_dir>/rank-<global_rank>.jsonl` (DESIGN section 7).

Each record is one line, in the page cache before the call returns, so that a process killed
mid-step (or hung inside a collective) still leaves every record up to that point on disk.
structlog's `BytesLogger` writes them (a vLLM step's transitions: `AuditLog.step_transition`)
into a memory-mapped file (`mapped`): a log that was not closed ends in blank lines, where
readers stop. `AuditLog.batch()` collects records written together (what a vLLM step logs once
its forward is over): each keeps its own `seq` and time, and the batch goes out as complete
lines in one write at `write()`. Per write, not per line, is what a hot loop pays for: the
lock, the structlog logger and the copy into the map each cost microseconds when cold.

A log written with the job's shape (the runner's, the vLLM worker's) is compact on disk
(`compact`: the `job` record in full, others in short keys; `read_records` gives them back in
full); under `max_log_bytes`, a sequence of segments (`segments`). Without a shape: in full.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from runner_fsm.audit import compact, compress, step_lane
from runner_fsm.audit.mapped import MappedFile
from runner_fsm.audit.recording import (_RESERVED, COLLECTIVE_STAGES, EVENTS, GRAPH_ACTIONS,  # noqa: F401
                                        HEADER_FIELDS, STOP_SOURCES, AuditBatch, _Records, _refuse_rendered)
from runner_fsm.audit.records import (TIME_FIELDS, AuditLogFormatError, plain_fields, plain_lines,  # noqa: F401
                                      read_records, strip_times)
from runner_fsm.audit.render import RecordRenderer
from runner_fsm.audit.segments import DEFAULT_PINNED_STEPS, Companion, SegmentPolicy
from runner_fsm.errors import RunnerError

# 2: the `job` record names every parallel dimension (TP, PP), the rank's coordinates and host
# (`audit.shape`); schema-1 logs still replay.
SCHEMA_VERSION = 2
# How long a signal handler waits for another thread's write (microseconds, normally) before
# leaving its record to that write: bounded, since the holder may be the interrupted thread
# itself caught between taking the lock and saying so.
_HANDLER_WAIT_S = 0.2
_get_ident, _monotonic_ns = threading.get_ident, time.monotonic_ns  # bound once: `step_transition`'s


class AuditLogClosedError(RunnerError):
    """A record was written to an audit log after `close()`."""


def log_path(run_dir: str | os.PathLike[str], global_rank: int) -> Path:
    """Where the audit log of the process with this global rank lives."""
    return Path(run_dir) / f"rank-{int(global_rank)}.jsonl"


# ---------------------------------------------------------------- the file


def _open_exclusive(path: Path, **options: Any) -> MappedFile:
    # Exclusive create: `seq` must run gapless from 0 in the file, so appending to an old
    # run would break it, and truncating would destroy its evidence.
    try:
        return MappedFile(path, **options)
    except FileExistsError as err:
        raise FileExistsError(f"audit log {path} already exists; start each run in a fresh run_dir") from err


# ---------------------------------------------------------------- the log


class AuditLog(_Records):
    """The audit log of one process; safe to write from several threads."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        run_id: str,
        global_rank: int,
        dp_rank: int,
        pcp_rank: int,
        *,
        shape: Mapping[str, Any] | None = None,
        max_log_bytes: int | None = None,
        pinned_steps: int = DEFAULT_PINNED_STEPS,
        compress_segments: bool = False,
    ):
        """`shape`: the job's shape (`audit.shape.job_shape_fields`), written as record 0 (of
        every segment) so that replay knows every rank the job has, whichever logs it finds;
        with it the records are compact on disk (`compact`). `max_log_bytes`: the cap of a
        segmented log (`segments`; it needs the shape), None for one file without a cap;
        `pinned_steps`: the steps kept before a fault, a `pin` and the current step;
        `compress_segments`: closed segments gzip-compressed (`compress`)."""
        if shape is not None and shape.keys() & _RESERVED:
            raise ValueError(f"job record: fields {sorted(shape.keys() & _RESERVED)} are reserved")
        if max_log_bytes and shape is None:
            raise ValueError("a log under max_log_bytes needs the job's shape: each segment begins with it")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = log_path(run_dir, global_rank)
        self._run_id, self._dp_rank, self._pcp_rank = str(run_id), int(dp_rank), int(pcp_rank)
        # seq and the file order must agree, so numbering and writing share one lock.
        self._lock = threading.Lock()
        self._closed = False
        self._deferred: collections.deque = collections.deque()  # records made in a signal handler
        # seq, the compact renderer's step and state, the file's room: one object a transition
        # touches (`step_lane`); `lane.open` while a step's transition may take the short path
        # (compact, no segment switch due, not closed)
        self.lane = step_lane.LaneState()
        self._holder: int | None = None  # the thread writing, while one is
        self._plain = RecordRenderer(SCHEMA_VERSION, self._run_id, self._dp_rank, self._pcp_rank)
        segments = dict(pinned_steps=pinned_steps, compress=compress_segments,  # the compressor's errors:
                        on_compress_error=lambda path, error: compress.report_failure(self, path, error))
        self._segments = SegmentPolicy(Path(run_dir), global_rank, max_log_bytes, **segments) if max_log_bytes else None
        self._compact: compact.CompactRenderer | None = None
        if shape is None:
            self._open_file(self.path)
            self._render_lines = plain_lines(self._plain)
        else:
            self._shape = {**shape, compact.FORMAT_FIELD: compact.FORMAT}
            self._open_segment(0)

    def _open_file(self, path: Path) -> None:
        segments = self._segments
        if segments is None:
            self._file = _open_exclusive(path, lane=self.lane)
        else:
            self._file = _open_exclusive(path, chunk=segments.chunk, full_at=segments.chunk,  # asked at each
                                         on_full=self._segment_full, lane=self.lane)  # growth: companions fill it too
        # structlog's BytesLogger writes each rendered line (or batch of lines) into the mapped
        # file before returning. Records are rendered here, not by a processor chain around it: the
        # chain held only this renderer, and its per-call context copy and dispatch cost more
        # than the encoding, on a path taken two or three times a step. The global structlog
        # configuration (the human-readable console) is never touched.
        self._logger = structlog.BytesLogger(self._file)

    def _open_segment(self, index: int) -> None:
        """Open segment `index` (the only one without a cap) and write its `job` record."""
        segments = self._segments
        self._open_file(self.path if segments is None else segments.path(index))
        fields = self._shape if segments is None else {**self._shape, **segments.job_fields()}
        t0 = time.monotonic_ns()
        self._logger.msg(self._plain.line(self.lane.seq, t0, "job", None, fields))
        self.lane.seq += 1
        self._compact = compact.CompactRenderer(t0, self._shape.get(compact.NAMES_FIELD), self.lane)
        self._render_lines = self._compact.lines
        self.lane.open = True

    @property
    def next_seq(self) -> int:
        """The seq the next record will get (= records written so far)."""
        return self.lane.seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def segments(self) -> SegmentPolicy | None:
        """The segments of a capped log (None: one file, no cap)."""
        return self._segments

    @property
    def current_path(self) -> Path:
        """The file records go to now (the last segment of a capped log)."""
        return self._file.path

    def add_companion(self, companion: Companion) -> None:
        """A file that goes with the segments (the vLLM step journal); nothing without a cap."""
        if self._segments is not None:
            self._segments.companions.append(companion)

    def pin(self, step_id: int | None, reason: str | None = None) -> None:
        """Keep the segment holding `step_id` (None: the current step) and the `pinned_steps`
        before it, whatever the cap (a fault pins itself; e.g. an injected fault firing)."""
        if self._segments is not None:
            with self._lock:
                current = self._compact.step if self._compact is not None else None
                self._segments.pin(step_id if step_id is not None else current)

    _pin = pin

    # -- records

    def batch(self) -> AuditBatch:
        """Records to write together (see the module docstring)."""
        return AuditBatch(self)

    @contextmanager
    def collective_span(self, step_id: int | None, group: str, op: str, phase: int | None, shapes: Any,
                        pg_seq: int | None) -> Iterator[None]:
        """`enqueue` before the body, `done` after it; nothing if the body raises.

        A dangling `enqueue` is exactly what the replay checker reads as a hang, so an error
        path must not paper over it with a `done` (the caller logs the `fault` itself).
        """
        self.collective(step_id, group, op, phase, shapes, pg_seq, "enqueue")
        yield
        self.collective(step_id, group, op, phase, shapes, pg_seq, "done")

    # -- lifecycle

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.lane.open = False
                self._file.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AuditLog({str(self.path)!r}, next_seq={self.lane.seq}, closed={self._closed})"

    # -- the one write path

    def _emit(self, event: str, step_id: int | None, fields: dict[str, Any] | bytes) -> None:
        self._write_all(((None, event, step_id, fields),))  # None: stamped under the lock

    def stop(self, step_id: int | None, source: str, signal: str | None = None, detail: str = "") -> None:
        """A stop request arrived (`source` "signal": `signal` names it; "shutdown": the engine's
        shutdown call). Safe in a signal handler: see `write_in_handler`."""
        if source not in STOP_SOURCES:
            raise ValueError(f"stop source must be one of {STOP_SOURCES}, got {source!r}")
        self.write_in_handler("stop", step_id, {"source": source, "signal": signal, "detail": str(detail)})

    def write_in_handler(self, event: str, step_id: int | None, fields: dict[str, Any]) -> None:
        """Write a record from a signal handler. Python runs the handler in the main thread between
        two bytecodes, possibly while that very thread holds the log's lock in the middle of a
        write: waiting for the lock there would never end. So the record is queued, and written
        now once the lock is free (waiting a moment for another thread's write: the process may
        die right after the handler), else by the write this thread is in, as soon as it is done.
        On a closed log it is dropped: a handler must never fail the signal's own handling."""
        self._deferred.append((time.monotonic_ns(), event, step_id, fields))
        self._write_deferred(wait_s=0.0 if self._holder == threading.get_ident() else _HANDLER_WAIT_S)

    def _write_deferred(self, wait_s: float = 0.0) -> None:
        deferred = self._deferred
        while deferred and self._lock.acquire(wait_s > 0, wait_s if wait_s > 0 else -1):
            self._holder = threading.get_ident()
            try:
                records = []
                while deferred:  # popleft, not a copy: a handler may append meanwhile
                    records.append(deferred.popleft())
                if records and not self._closed:  # another thread may have written them while this one waited
                    self._logger.msg(self._render_lines(self.lane.seq, records, time.monotonic_ns()))
                    self.lane.seq += len(records)
            finally:
                self._holder = None
                self._lock.release()

    def rendered(self, event: str, step_id: int | None, body: bytes) -> None:
        """A record whose fields are rendered already (see `_Records`), written at once (a vLLM
        step's start, before its forward)."""
        if event not in EVENTS or type(body) is not bytes or len(body) < 2 or body[0] != 123 or body[-1] != 125:
            _refuse_rendered(event)  # not a known event, or not a JSON object {...} as bytes
        self._write_all(((None, event, step_id, body),))

    def step_transition(self, step_id: int | None, body: bytes, tail: bytes = b"",
                        batch: AuditBatch | None = None) -> None:
        """A transition rendered already (`body` from `compact.transition_body`, `tail` its own
        fields as `rendered_transition` takes them), written at once, after what `batch` holds
        (records of the same step, collected: the batch is empty afterwards), in one write.

        The vLLM worker's step start and end, right after vLLM evicted the CPU caches: the general
        path (a batch, `_write_all`, the renderer's loop, structlog's logger) cost 25-30 us a step
        more. Same lines, seq and lock; a log written in full, or whose full segment waits for its
        step's end, goes that path. Not through structlog's BytesLogger: without its second lock,
        copy and three calls."""
        pending = batch._pending if batch is not None else ()
        if not self.lane.open:
            if batch is not None:
                batch._pending = []
            return self._write_all((*pending, (None, "transition", step_id, (body, tail) if tail else body)))
        try:
            with self._lock:
                self._holder = _get_ident()  # a signal handler must know whether to wait
                try:
                    if self._closed:
                        raise AuditLogClosedError(
                            f"audit log {self.path} is closed; cannot write 'transition' (step {step_id})")
                    seq, now = self.lane.seq, _monotonic_ns()
                    if pending:
                        batch._pending = []
                        line = self._compact.lines(seq, pending, now) + b"\n" + \
                            self._compact.transition(seq + len(pending), step_id, now, body, tail)
                    else:
                        line = self._compact.transition(seq, step_id, now, body, tail)
                    self._file.write(line)
                    self.lane.seq = seq + len(pending) + 1
                finally:
                    self._holder = None
        finally:
            if self._deferred:  # a signal handler's record (see `_write_all`)
                self._write_deferred()

    def _write_all(self, records) -> None:
        """Number, render and write `records` ((t_ns, event, step_id, fields), ...) in one write.

        A record of a batch keeps the time it was made, so t_ns may step back by a few
        microseconds against a record another thread wrote meanwhile; seq is the file order."""
        lane = self.lane  # read once, and the clock and get_ident bound once: the write path
        try:              # runs 7 times an embedded step (bench_bookkeeping)
            with self._lock:
                self._holder = _get_ident()  # a signal handler must know whether to wait
                try:
                    if self._closed:
                        first = records[0]
                        raise AuditLogClosedError(
                            f"audit log {self.path} is closed; cannot write {first[1]!r} (step {first[2]})"
                        )
                    # seq is only consumed once the lines are written: a record that fails to
                    # serialise leaves no gap behind.
                    seq = lane.seq
                    self._logger.msg(self._render_lines(seq, records, _monotonic_ns()))
                    lane.seq = seq + len(records)
                finally:
                    self._holder = None
        finally:
            # A signal handler ran while this write held the lock: its record follows the write,
            # also when the handler then raised in it (KeyboardInterrupt, vLLM's SystemExit),
            # which may end the process with no other write to carry it.
            if self._deferred:
                self._write_deferred()

    # -- segments: the write path while a full segment waits for its step to end

    def _segment_full(self, log_bytes: int) -> int | None:
        """The log's file grows (called from inside a write): if the current segment filled
        (`SegmentPolicy.full`), until the next step begins each write looks for that step's
        first record and switches segments before it; else asked again at the next growth."""
        if not self._segments.full(log_bytes):
            return 0
        self._write_all = self._write_watching
        self.lane.open = False
        return None

    def _write_watching(self, records) -> None:
        with self._lock:
            step = records[0][2]
            if not self._closed and step is not None and step != self._compact.step:
                self._segments.switch(step, self._file.close, self._open_segment)
                del self._write_all  # the plain write path again
                self.lane.open = True
        AuditLog._write_all(self, records)
