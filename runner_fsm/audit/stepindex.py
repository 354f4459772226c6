"""Where each step of a closed compact segment begins: its step index, `<segment>.idx`.

Written by the writer when it closes a segment (`segments`), next to it: the segment's first and
last step, its size, and every `STRIDE` bytes the first step that begins there, with its byte
offset and line number. A step's first record is the line that starts with `{"s":`
(`compact`), so the index is found with a few `find` calls, never by parsing the segment, and
costs the writer a few milliseconds per segment. Replay seeks with it (`ranges`); a segment
without one (the open one, a log of an older writer) is bisected instead, the same answer.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import NamedTuple

from runner_fsm.audit.mapped import data_end

STRIDE = 1 << 16  # at most this far apart (a small segment's entries: a 64th of it apart)
_STEP_LINE = b'\n{"s":'


class StepIndex(NamedTuple):
    first_step: int | None  # None: the segment holds no step (e.g. a head of start-up records)
    last_step: int | None
    size: int  # the bytes it indexes: a segment that changed since is indexed anew
    entries: tuple[tuple[int, int, int], ...]  # (step, byte offset, line number), by offset
    # a compressed segment (`compress`): (byte offset in the text, offset of its gzip member)
    members: tuple[tuple[int, int], ...] = ()
    compressed_size: int | None = None

    def locate(self, step: int) -> tuple[int, int]:
        """(offset, line number) of an indexed step at or before `step`'s first record (the
        start of the segment's records when none is)."""
        best = (0, 1)
        for found, offset, line in self.entries:
            if found > step:
                break
            best = (offset, line)
        return best


def index_path(segment: Path) -> Path:
    """`<segment>.idx`, for a segment and for its compressed form alike."""
    name = segment.name[:-3] if segment.name.endswith(".gz") else segment.name
    return segment.with_name(name + ".idx")


def build(path: Path) -> StepIndex:
    """The index of a compact segment (see the module docstring)."""
    size = data_end(path)
    if size == 0:
        return StepIndex(None, None, 0, ())
    stride = max(4096, min(STRIDE, size // 64))
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        entries, lines, counted = [], 1, 0
        position = 0
        while True:
            found = data.find(_STEP_LINE, position, size)
            if found < 0:
                break
            lines += data[counted:found + 1].count(b"\n")  # a stride at a time: memory stays small
            counted = found + 1
            entries.append((_step_at(data, found + 1), found + 1, lines))
            position = max(found + 1, (found + 1) // stride * stride + stride)
        last = data.rfind(_STEP_LINE, 0, size)
        last_step = _step_at(data, last + 1) if last >= 0 else None
    steps = [e for e in entries if e[0] is not None]
    return StepIndex(steps[0][0] if steps else None, last_step, size, tuple(steps))


def _step_at(data, offset: int) -> int | None:
    """The step of the compact step line at `offset` (`{"s":N,...`), None for `{"s":null`."""
    end = data.find(b",", offset, offset + 32)
    try:
        return int(data[offset + 5:end])
    except ValueError:
        return None


def write(path: Path, index: StepIndex | None = None, **compressed) -> StepIndex:
    """Index `path` (or store `index`, with a compressed form's `members` and
    `compressed_size`) next to it, atomically: a reader sees all of it or none."""
    index = (index or build(path))._replace(**compressed)
    target = index_path(path)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(index._asdict()))
    os.replace(temporary, target)
    return index


def read(path: Path) -> StepIndex | None:
    """The cached index of `path` (a segment, or its compressed form), when there is one for
    its current size; else None."""
    try:
        cached = json.loads(index_path(path).read_text())
        size = cached["compressed_size"] if path.name.endswith(".gz") else cached["size"]
        if size != os.stat(path).st_size:
            return None
        return StepIndex(cached["first_step"], cached["last_step"], cached["size"],
                         tuple(tuple(e) for e in cached["entries"]),
                         tuple(tuple(m) for m in cached.get("members", ())), cached.get("compressed_size"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
