"""The audit log's file, written through a shared memory map instead of a system call per write.

A `write` copies the line into a `MAP_SHARED` mapping of the file: the bytes are in the page
cache when the call returns, exactly where a `write(2)` would have put them, so a process
killed right after (SIGKILL, a segfault in a kernel library) leaves them on disk just the
same; a crash of the machine loses unsynced pages either way. What changes is the cost:
inside vLLM, where the CPU caches are cold at every step, a `write(2)` of a few hundred bytes
costs 12-20 us of thread CPU, the copy 5-6 us (the page faults included).

The file grows by `CHUNK` bytes at a time, reserved on disk first (`posix_fallocate`: a full
disk raises `OSError` here, instead of SIGBUS at a later copy) and filled with newlines. So
while the file is open, and after a process died without closing it, it ends in up to `CHUNK`
blank bytes: newlines, or zeros where the fill never reached the disk (a machine crash, a kill
during the fill). The writer never writes a blank line, so the first blank line is where the
written part ends (`is_blank`, `data_end`, `rest_is_blank`): every reader here stops there.
`jq` skips the blank lines too; line counts (`wc -l`, `tail -n`) include them, and `tail -f`
does not follow the file (nothing changes its size between chunks). `close()` cuts the file to
what was written: a log closed normally is byte for byte what `write(2)` would have left.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from runner_fsm.audit import step_lane

CHUNK = 1 << 18  # bytes reserved at a time: a resize every few hundred vLLM steps
_FILL = b"\n"
BLANK = b"\n\x00"  # the bytes of the unwritten tail: the fill, or zeros it never replaced


def is_blank(line: bytes) -> bool:
    """True for the unwritten tail's lines: no record (the writer never writes an empty line)."""
    return not line.strip(BLANK)


def rest_is_blank(handle, limit: int = 4 * CHUNK) -> bool:
    """Whether everything after `handle`'s position is blank (then the log ends there). Reads
    at most `limit` bytes; when the rest is not blank the position is put back."""
    position = handle.tell()
    rest = handle.read(limit + 1)
    if len(rest) <= limit and is_blank(rest):
        return True
    handle.seek(position)
    return False


def data_end(path: str | os.PathLike[str]) -> int:
    """The end of the written bytes of an audit file: its size less a blank tail left by a
    writer that did not close it (0 when nothing was written)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            handle.seek(start)
            chunk = handle.read(end - start).rstrip(BLANK)
            if chunk:
                return start + len(chunk) + 1 if start + len(chunk) < size else size
            end = start
    return 0


class MappedFile:
    """Append-only binary file (created exclusively) written through a memory map; a file-like
    object for structlog's `BytesLogger` (`write`, `flush`, `close`, `closed`). One process
    writes it: a forked child writing its inherited copy would write over the parent's lines.

    Its bytes mapped and not written yet live in `lane.room` (`step_lane.LaneState`, shared
    with the log that writes it: one object a transition touches); `write` grows the file
    where needed. Its own lane unless one is given."""

    def __init__(self, path: str | os.PathLike[str], *, chunk: int = CHUNK, full_at: int | None = None,
                 on_full=None, lane: Any = None):
        """`full_at`, `on_full`: `on_full(size)` is called from the write that grows the file past
        `full_at` bytes (`size`: the bytes mapped, all written but the write's own), and returns
        None (the file is full: not called again) or the size to call it again at (a capped log's
        segment, whose files beside it count too: `audit.segments`). The check rides on the growth a write needs anyway, so a write costs nothing more for it."""
        self.path = Path(path)
        self._chunk = int(chunk)
        self._full_at, self._on_full = full_at, on_full
        self.lane = step_lane.LaneState() if lane is None else lane
        self.lane.room = 0  # bytes mapped and not written yet (written: `_size - room`)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        self._pid = os.getpid()  # the writer: a forked child never cuts the file under it
        self._size = 0  # bytes mapped
        self._mapping: mmap.mmap | None = None
        try:
            self._grow(0)
        except BaseException:  # e.g. a full disk: no empty file left to block the next try
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @property
    def room(self) -> int:
        """Bytes mapped and not written yet."""
        return self.lane.room

    def write(self, data: bytes) -> int:
        size, lane = len(data), self.lane
        if size > lane.room:
            if self._fd < 0:
                raise ValueError(f"write to closed audit file {self.path}")
            self._grow(self._size - lane.room + size)
        end = self._size - lane.room  # the end of what was written (the lane's writes too)
        self._mapping[end:end + size] = data
        lane.room -= size
        return size

    # Nothing to flush: each write is in the page cache when it returns. structlog's BytesLogger
    # calls `flush()` after every write, two or three times a vLLM step: `NoneType()` (a C-level
    # callable returning None) stands in for a Python method, one frame less per write.
    flush = staticmethod(type(None))

    def close(self) -> None:
        if self._fd < 0:
            return
        lane = self.lane
        try:
            self._mapping.close()
            if os.getpid() == self._pid:
                os.ftruncate(self._fd, self._size - lane.room)  # the blank tail goes
        finally:
            os.close(self._fd)
            self._fd = -1
            lane.room = 0  # nothing more is written; `write` raises

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size - self.lane.room

    def _grow(self, needed: int) -> None:
        if self._full_at is not None and self._size >= self._full_at:
            self._full_at = None  # not called again should it raise
            self._full_at = self._on_full(self._size)
        chunk = self._chunk
        size = max(self._size + chunk, -(-needed // chunk) * chunk)  # whole chunks
        allocate = getattr(os, "posix_fallocate", None)
        if allocate is not None:
            allocate(self._fd, self._size, size - self._size)  # ENOSPC now, not SIGBUS later
        else:  # pragma: no cover - platforms without posix_fallocate (macOS)
            os.ftruncate(self._fd, size)
        lane = self.lane
        if self._mapping is None:
            self._mapping = mmap.mmap(self._fd, size)
        else:
            self._mapping.resize(size)
        self._mapping[self._size:size] = _FILL * (size - self._size)
        lane.room += size - self._size
        self._size = size
