"""Finding steps in a rank's files without reading them from the start.

A rank's log is ordered by step, in every segment and across them, so the byte offset where any
step begins is found by bisection (`seek_step`), or, in a closed compact segment, from its step
index (`stepindex`). A compact record carries its step only where a step begins (`{"s":...`,
`compact`): those lines are the ones a seek lands on.

What lies before the place a seek lands on is counted only when a verdict needs it
(`SeekOrigin`): the line numbers a verdict cites, and a compact segment's time base (its times
run on from step to step, from the segment's `job` record). Counting them reads the segment
from its start, which a seek is there to avoid: most windows of a long run are sound.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson

from runner_fsm.audit import stepindex
from runner_fsm.audit.compress import open_lines
from runner_fsm.audit.mapped import data_end, is_blank

_TAIL = 1 << 16


def _step_of(raw: bytes):
    """The step of a line that names one: a record in full, or a compact step's first record."""
    if b'"s"' not in raw and b'"step_id"' not in raw:  # most compact lines: not parsed (a seek reads hundreds)
        return None
    try:
        record = orjson.loads(raw)
        step = record["s"] if "s" in record else record["step_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _first_step_from(handle, position: int) -> tuple[int, int | None]:
    """(start of the first whole line at or after `position` that has a step, that step);
    (end of file, None) when there is none."""
    handle.seek(position)
    if position:
        handle.readline()  # the rest of a line that started earlier
    while True:
        start = handle.tell()
        raw = handle.readline()
        if not raw or is_blank(raw):  # the end, or the blank tail of an unclosed log
            return start, None
        step = _step_of(raw)
        if step is not None:
            return start, step


def seek_step(path: Path, step: int) -> int:
    """Byte offset of the first line of `path` whose step is `step` or later (the end of its
    data when there is none), by bisection: the file is ordered by step."""
    with open(path, "rb") as handle:
        low, high = 0, data_end(path)
        while high - low > _TAIL:
            middle = (low + high) // 2
            start, found = _first_step_from(handle, middle)
            if found is None or found >= step:
                if start >= high:
                    break
                high = start
            else:
                low = middle
        handle.seek(low)
        if low:
            handle.readline()  # the rest of a line that started before `low`
        while True:
            start = handle.tell()
            raw = handle.readline()
            found = _step_of(raw) if raw else None
            if not raw or is_blank(raw) or (found is not None and found >= step):
                return start


def last_step_of(path: Path) -> int | None:
    """The step of the last readable record of `path` (None when it has none)."""
    size = data_end(path)  # without the blank tail of a log that was not closed
    with open(path, "rb") as handle:
        span = _TAIL
        while True:
            handle.seek(max(0, size - span))
            lines = handle.read(size - max(0, size - span)).splitlines()
            for raw in reversed(lines[1:] if size > span else lines):
                step = _step_of(raw)
                if step is not None:
                    return step
            if span >= size:
                return None
            span *= 4


# A compact step's first line and its time since the previous step's first line (`compact`)
_STEP_TIME = re.compile(rb'\n\{"s":(?:-?\d+|null),"q":\d+,"t":(-?\d+)')
_CHUNK = 1 << 20


class SeekOrigin:
    """What lies before byte `offset` of a segment a scan jumped to, counted on the first ask
    (one pass over the bytes before it, then kept): the lines before it, for a verdict's line
    number where the seek did not give one (`line_known`: the scan numbers lines from the
    right number already), and, in a compact segment, the time base a scan from the start would
    have had there. Small and plain: a range's findings cross a pipe (`ranges`)."""

    __slots__ = ("path", "offset", "compact", "line_known", "_counted")

    def __init__(self, path: Path, offset: int, *, compact: bool, line_known: bool):
        self.path, self.offset, self.compact, self.line_known = path, offset, compact, line_known
        self._counted: tuple[int, int] | None = None  # (lines, sum of step times in us)

    def line_shift(self) -> int:
        """Lines to add to a line numbered from 1 at the seek (0 where the seek knew its line)."""
        return 0 if self.line_known else self._count()[0]

    def time_shift(self) -> int:
        """Nanoseconds to add to a `t_ns` read after the seek: an `Expander` resumed there counts
        the steps' times on from the segment's `job` record, a scan from the start from every
        step before (the sum of their `t`, microseconds, as that scan adds them)."""
        return self._count()[1] * 1000 if self.compact else 0

    def _count(self) -> tuple[int, int]:
        if self._counted is None:
            lines = micros = 0
            carry = b""  # the end of the last chunk from its last newline on
            with open_lines(self.path) as handle:
                left = self.offset
                while left > 0:
                    chunk = handle.read(min(left, _CHUNK))
                    if not chunk:
                        break
                    left -= len(chunk)
                    lines += chunk.count(b"\n")
                    if self.compact:
                        data = carry + chunk
                        cut = data.rfind(b"\n")
                        whole, carry = (data[:cut], data[cut:]) if cut >= 0 else (b"", data)
                        micros += sum(map(int, _STEP_TIME.findall(whole)))
            self._counted = (lines, micros)
        return self._counted


def locate(path: Path, step: int, *, compact: bool = False) -> tuple[int, int | None]:
    """(byte offset, line number) of the first line of `path` whose step is `step` or later
    (the end of its data when there is none): from the segment's step index where it has one
    for its size (line number and all), else by bisection (line number None: counting the
    lines before it would read the file from its start; `SeekOrigin` does, when asked)."""
    index = stepindex.read(path) if compact else None
    if index is not None and index.members:  # compressed: from the member that holds the step on
        return index.locate(step)
    if index is None:
        return seek_step(path, step), None
    offset, line = index.locate(step)
    with open(path, "rb") as handle:
        handle.seek(offset)
        while True:
            raw = handle.readline()
            found = _step_of(raw) if raw else None
            if not raw or is_blank(raw) or (found is not None and found >= step):
                return offset, line
            offset, line = offset + len(raw), line + 1
