"""A rank's audit log under a byte cap: a sequence of segments, the oldest deleted first.

With `max_log_bytes` the log is cut into segments of about `max_log_bytes / SEGMENTS` bytes
(at least `MIN_SEGMENT`, at most a quarter of the cap: a small cap still rotates):
`rank-<g>.jsonl` (segment 0), then `rank-<g>.<k>.jsonl`. What else the rank writes goes with
the segments (`Companion`: the vLLM step journal, `vllm-steps-<g>[.<k>].jsonl`) or counts
against the cap as it is (the Flight Recorder dump `fr-rank-<g>.json`, replaced at each dump).
A segment's size is its log's bytes and its companions' together: it closes at the first step
boundary after that sum filled it (`mapped.MappedFile` asks at each growth of the log's file,
at no cost per write), so every step lies in one segment, and each segment begins with the
job's `job` record (`segment`: its number, `first_step`).

The cap covers every byte of the rank's files: the segments (plain or compressed), their
step indexes (`.idx`) and companions, and the Flight Recorder dump, whose share of the cap
(`flight_entries`) is kept free for it. At each switch the closed segments are kept, oldest
deleted first, while they and what the next segment may take (the largest segment so far, the
log file's mapped tail) fit in the cap. Never deleted:
- segment 0's head, the `job` record and the start-up records before step 0 (graph captures:
  every replay is judged against them); the rest of segment 0 goes like any segment's;
- a segment holding a pin (a `fault`, which includes the watchdog's report, or `pin()`, e.g.
  an injected fault firing) and the segments holding the `pinned_steps` steps before it.
A hang leaves no record to pin: its last segment is the open one, never deleted, and the
segments holding the `pinned_steps` steps before the current step are kept too (a hang may
come at any step), unless only they stand in the way: then the newest of those goes.
When pins alone leave no room, unpinned data goes newest first, and the next segment's `job`
record lists what (`dropped`). Pins are the only thing that may take the files over the cap:
then the next segment's `job` record says by how much (`over_cap`), and `disk_peak` the most
they took at any switch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from runner_fsm.audit import stepindex
from runner_fsm.audit.compress import Compressor, compressed
from runner_fsm.audit.mapped import CHUNK
from runner_fsm.audit.stepindex import index_path

SEGMENTS = 16  # a cap is cut into about this many segments
MIN_SEGMENT = 64 << 10  # smaller segments would be mostly `job` records
DEFAULT_MAX_LOG_BYTES = 2 << 30  # per rank: audit log, step journal and Flight Recorder dump together
DEFAULT_PINNED_STEPS = 1000  # kept before a fault, a pin, and before the current step
# The Flight Recorder's dump is rewritten whole at each dump, as large as its ring: under a cap
# the ring is sized to take at most an eighth of it (`flight_entries`), and that much is kept
# free for it at every switch (the end-of-run dump comes after the last one).
FLIGHT_SHARE = 8
FLIGHT_ENTRY_BYTES = 512  # a dumped entry, with the group names around it (measured: ~480)
MAX_FLIGHT_ENTRIES = 2000  # torch's own default ring (a hang)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | int | None) -> int | None:
    """'2G', '512M', '65536', 0 or None (no cap) as bytes: None for no cap; ValueError otherwise."""
    if text is None or isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
        if match is None:
            raise ValueError(f"expected a byte count such as 2G, 512M or 1048576, got {text!r}")
        value = int(match[1]) * _UNITS[match[2].lower()]
    if value is not None and value < 0:
        raise ValueError(f"a byte count cannot be negative, got {text!r}")
    return value or None


def segment_name(stem: str, global_rank: int, index: int) -> str:
    """`<stem>-<rank>.jsonl` for segment 0, `<stem>-<rank>.<index>.jsonl` after it."""
    return f"{stem}-{int(global_rank)}.jsonl" if index == 0 else f"{stem}-{int(global_rank)}.{index}.jsonl"


def flight_entries(max_log_bytes: int | None) -> int:
    """Flight Recorder entries to record under `max_log_bytes` (its share of the cap)."""
    if not max_log_bytes:
        return MAX_FLIGHT_ENTRIES
    return max(16, min(MAX_FLIGHT_ENTRIES, max_log_bytes // FLIGHT_SHARE // FLIGHT_ENTRY_BYTES))


def segment_bytes(max_log_bytes: int) -> int:
    """A segment's size (log and companions): a cap's `SEGMENTS`-th, at least `MIN_SEGMENT`,
    at most a quarter of the cap (below 256 KiB one segment of `MIN_SEGMENT` could not rotate)."""
    return min(max(MIN_SEGMENT, max_log_bytes // SEGMENTS), max(4096, max_log_bytes // 4))


def chunk_bytes(max_log_bytes: int) -> int:
    """The mapped file's growth step under a cap: a small cap overshoots by little."""
    return min(CHUNK, max(4096, segment_bytes(max_log_bytes) // 16 // 4096 * 4096))


class Companion(Protocol):
    """A file that goes with the audit log's segments (the vLLM step journal)."""

    def segment_path(self, index: int) -> Path: ...

    def size(self) -> int:
        """Bytes of the current segment so far, those still buffered included."""

    def rotate(self, index: int) -> None:
        """Close the current segment and write `index` from now on."""


@dataclasses.dataclass
class Segment:
    index: int
    first_step: int | None  # the step it begins with (None: segment 0, which begins with start-up)
    last_step: int | None = None  # None while open
    head_end: int | None = None  # segment 0 cut to its head: its size then

    @property
    def pinned_head(self) -> bool:
        return self.index == 0


@dataclasses.dataclass(frozen=True)
class Switch:
    """One segment switch: the disk the rank's files took just before it and right after it."""

    index: int
    first_step: int
    bytes_before: int
    bytes_after: int
    deleted: tuple[int, ...]


class SegmentPolicy:
    """Which segments to keep at each switch (see the module docstring); does the deleting."""

    def __init__(self, run_dir: Path, global_rank: int, max_log_bytes: int, *,
                 pinned_steps: int = DEFAULT_PINNED_STEPS, extra_files: tuple[Path, ...] = (), compress: bool = False,
                 on_compress_error: Callable[[Path, OSError], None] | None = None):
        """`compress`: closed segments (not segment 0) rewritten as gzip in a thread (`compress`);
        `on_compress_error(path, error)`: one of them could not be (it stays plain)."""
        self.run_dir, self.global_rank = Path(run_dir), int(global_rank)
        self.cap = int(max_log_bytes)
        self.segment_bytes = segment_bytes(self.cap)
        self.chunk = chunk_bytes(self.cap)
        self.pinned_steps = int(pinned_steps)
        self.extra_files = tuple(extra_files) or (self.run_dir / f"fr-rank-{self.global_rank}.json",)
        self.flight_reserve = flight_entries(self.cap) * FLIGHT_ENTRY_BYTES  # its dump, however large it gets
        self.companions: list[Companion] = []
        self.closed: list[Segment] = []
        self.current = Segment(0, None)
        self.pins: list[int] = []  # steps pinned (faults, `pin()`)
        self.dropped: list[tuple[int, int]] = []  # (first, last) steps deleted for pins, not yet reported
        self.switches: list[Switch] = []  # the last few, for checks
        self.peak = 0  # the most the rank's files took at any switch (right before it: their fullest)
        self._largest = 0  # the most a closed segment took (its log, index and companions)
        self.compressor = Compressor(on_compress_error) if compress else None

    def path(self, index: int) -> Path:
        return self.run_dir / segment_name("rank", self.global_rank, index)

    def pin(self, step: int | None) -> None:
        if step is not None:
            self.pins.append(int(step))

    # -- the switch

    def full(self, log_bytes: int) -> bool:
        """Whether the current segment is full: its log's `log_bytes` and its companions' bytes
        (`MappedFile`'s `on_full` asks at each growth of the log's file)."""
        return log_bytes + sum(companion.size() for companion in self.companions) >= self.segment_bytes

    def switch(self, first_step: int, close_current: Callable[[], None], open_next: Callable[[int], None]) -> None:
        """Close the current segment (`close_current`) before `first_step`, delete what must go,
        then `open_next(index)` the next one and move the companions."""
        before = self.disk_bytes()  # the fullest the files get: the open segment at its mapped size
        self.peak = max(self.peak, before)
        close_current()
        following = self.current.index + 1
        for companion in self.companions:  # their segments closed too: on disk whole, as they count
            companion.rotate(following)
        closed = self.path(self.current.index)
        index = stepindex.write(closed) if closed.exists() else None  # where each of its steps begins
        last = index.last_step if index is not None else None
        self.current.last_step = last if last is not None else first_step - 1
        self.closed.append(self.current)
        if self.compressor is not None and self.current.index > 0:
            self.compressor.submit(closed)
        self._largest = max(self._largest, self._segment_disk_bytes(self.current))
        deleted = self._make_room(first_step)
        self.current = Segment(following, first_step)
        open_next(following)
        self.switches = [*self.switches[-63:], Switch(self.current.index, first_step, before, self.disk_bytes(),
                                                      tuple(deleted))]

    def _make_room(self, now: int) -> list[int]:
        """Delete closed segments until the kept ones and the next segment fit in the cap."""
        deleted = []
        dump = sum(self._size(f) for f in self.extra_files)  # the Flight Recorder's: it may grow to its share
        # the next segment may take as much as the largest so far (its step boundary's overshoot
        # and its companions' share measured), one chunk more to the growth that finds it full,
        # and one for its log's mapped tail
        room = self.cap - max(self.segment_bytes, self._largest) - 2 * self.chunk - max(0, self.flight_reserve - dump)
        if self.compressor is not None:  # a segment and its compressed form side by side, a while
            room -= self.segment_bytes // 2
        while self._kept_bytes() > room:
            victim = self._victim(now)
            if victim is None:
                break
            deleted.append(victim.index)
            self._delete(victim)
        return deleted

    def _victim(self, now: int) -> Segment | None:
        """The oldest segment no pin holds; else the newest one only the tail window holds
        (unpinned data, newest first: `dropped`)."""
        candidates = [s for s in self.closed if not (s.pinned_head and s.head_end is not None)]
        free = [s for s in candidates if not self._pinned(s) and not self._in_tail(s, now)]
        if free:
            return free[0]
        tail = [s for s in candidates if not self._pinned(s)]
        if tail:
            victim = tail[-1]
            self.dropped.append((victim.first_step if victim.first_step is not None else 0, victim.last_step))
            return victim
        return None

    def _pinned(self, segment: Segment) -> bool:
        first = segment.first_step if segment.first_step is not None else -1
        return any(first <= pin and segment.last_step >= pin - self.pinned_steps for pin in self.pins)

    def _in_tail(self, segment: Segment, now: int) -> bool:
        return segment.last_step >= now - self.pinned_steps

    def _delete(self, segment: Segment) -> None:
        with self.compressor.lock if self.compressor is not None else contextlib.nullcontext():
            self._delete_files(segment)

    def _delete_files(self, segment: Segment) -> None:
        for companion in self.companions:
            _unlink(companion.segment_path(segment.index))
        _unlink(index_path(self.path(segment.index)))
        _unlink(compressed(self.path(segment.index)))
        if segment.pinned_head:  # cut to its head; the head stays
            segment.head_end = head_end(self.path(0))
            os.truncate(self.path(0), segment.head_end)
        else:
            _unlink(self.path(segment.index))
            self.closed.remove(segment)

    # -- what the rank's files take

    def _kept_bytes(self) -> int:
        return sum(self._size(f) for f in self.extra_files) + sum(map(self._segment_disk_bytes, self.closed))

    def _segment_disk_bytes(self, segment: Segment) -> int:
        """A closed segment's files: its log (plain and compressed), its step index, its companions."""
        path = self.path(segment.index)
        return (self._size(path) + self._size(compressed(path)) + self._size(index_path(path))
                + sum(self._size(c.segment_path(segment.index)) for c in self.companions))

    def disk_bytes(self) -> int:
        """Bytes of every file of this rank now: kept segments, the open one (its mapped
        size: the unwritten tail is reserved on disk), companions, the Flight Recorder dump."""
        return self._kept_bytes() + self._size(self.path(self.current.index)) + sum(
            self._size(c.segment_path(self.current.index)) for c in self.companions)

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            return 0

    def job_fields(self) -> dict:
        """What the current segment's `job` record says of the segments (`audit.shape` extra)."""
        fields = {"segment": self.current.index, "max_log_bytes": self.cap}
        if self.current.first_step is not None:
            # where the segment begins, and what the rank's files took at this switch and at the
            # fullest of any (a reader can check the cap from the newest segment alone)
            fields.update(first_step=self.current.first_step, disk_bytes=self.disk_bytes(), disk_peak=self.peak)
        if self.dropped:
            fields["dropped"] = [list(span) for span in self.dropped]
            self.dropped = []
        pinned = self._kept_bytes()
        if pinned + self.segment_bytes > self.cap:
            fields["over_cap"] = pinned + self.segment_bytes - self.cap
        return fields


def head_end(path: Path) -> int:
    """Bytes of a log's head: its `job` record and the records before step 0 (start-up)."""
    import orjson

    with open(path, "rb") as lines:
        offset = 0
        for raw in lines:
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError:
                break
            step = record.get("s", record.get("step_id")) if isinstance(record, dict) else None
            if isinstance(step, int) and step >= 0:
                break
            offset += len(raw)
        return offset


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
