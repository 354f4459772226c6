"""Finding steps in a rank's files without reading them from the start.

A rank's log is ordered by step, in every segment and across them, so the byte offset where any
step begins is found by bisection (`seek_step`), or, in a closed compact segment, from its step
index (`stepindex`). A compact record carries its step only where a step begins (`{"s":...`,
`compact`): those lines are the ones a seek lands on.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from runner_fsm.audit import stepindex
from runner_fsm.audit.mapped import data_end, is_blank

_TAIL = 1 << 16


def _step_of(raw: bytes):
    """The step of a line that names one: a record in full, or a compact step's first record."""
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


def newlines_before(path: Path, offset: int) -> int:
    count = 0
    with open(path, "rb") as handle:
        while offset > 0:
            chunk = handle.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count




def locate(path: Path, step: int, *, compact: bool = False) -> tuple[int, int]:
    """(byte offset, line number) of the first line of `path` whose step is `step` or later
    (the end of its data when there is none): from the segment's step index where it has one
    for its size, else by bisection."""
    index = stepindex.read(path) if compact else None
    if index is not None and index.members:  # compressed: from the member that holds the step on
        return index.locate(step)
    if index is None:
        offset = seek_step(path, step)
        return offset, newlines_before(path, offset) + 1
    offset, line = index.locate(step)
    with open(path, "rb") as handle:
        handle.seek(offset)
        while True:
            raw = handle.readline()
            found = _step_of(raw) if raw else None
            if not raw or is_blank(raw) or (found is not None and found >= step):
                return offset, line
            offset, line = offset + len(raw), line + 1
