"""One rank's log as replay finds it: its segments, the steps each holds, what was rotated away.

A log is one file (`rank-<g>.jsonl`, as every log was before logs had a cap) or the segments a
capped writer kept (`segments`): `rank-<g>.jsonl` (segment 0, perhaps cut to its head of
start-up records) and `rank-<g>.<k>.jsonl`. The steps of a segment that is gone are
*rotated away*: between two kept segments whose numbers are not consecutive, and after
segment 0's head when the next kept segment is not segment 1. Each segment's first step is in
its `job` record (`first_step`), its last in its step index (`stepindex`) or its last line.
"""

from __future__ import annotations

import dataclasses
from itertools import islice
from pathlib import Path

import orjson

from runner_fsm.audit import stepindex
from runner_fsm.audit.compact import is_compact
from runner_fsm.audit.compress import is_compressed, open_lines

RANK_SEGMENT_PATTERN = r"^rank-(\d+)(?:\.(\d+))?\.jsonl(?:\.gz)?$"


@dataclasses.dataclass(frozen=True)
class SegmentFile:
    """One kept segment of a rank's log."""

    index: int
    path: Path
    first_step: int | None  # its job record's `first_step` (None: segment 0, or not said)
    compact: bool
    job: dict | None = dataclasses.field(default=None, compare=False, repr=False)
    # it goes on where the kept segment before it ended (no step rotated away in between)
    follows: bool = False

    @property
    def file(self) -> str:
        return self.path.name


def read_segments(numbered: list[tuple[int, Path]]) -> tuple[SegmentFile, ...]:
    """The segments of one rank (`rundirs.ranked_segments`), each with its `job` record and
    whether it follows the one before it: the next one by number, and that one not cut (the
    writer cuts segment 0 to its head when the rest of it goes)."""
    out: list[SegmentFile] = []
    for index, path in numbered:
        job = first_record(path)
        compact = is_compact(job)
        first = job.get("first_step") if job is not None else None
        first = first if isinstance(first, int) else None
        follows = False
        if out and out[-1].index + 1 == index:
            end = last_step(out[-1])
            follows = first is None or end is None or end + 1 >= first
        out.append(SegmentFile(index, path, first, compact, job, follows))
    return tuple(out)


def first_record(path: Path) -> dict | None:
    """The first line of `path` as a record (a segment's `job` record), or None."""
    try:
        with open_lines(path) as lines:
            for raw in islice(lines, 1):
                record = orjson.loads(raw)
                return record if isinstance(record, dict) else None
    except (OSError, EOFError, orjson.JSONDecodeError):
        return None
    return None


def last_step(segment: SegmentFile) -> int | None:
    """The last step `segment` holds (its index, else its last line with a step)."""
    index = stepindex.read(segment.path) if segment.compact else None
    if index is not None:
        return index.last_step
    if is_compressed(segment.path):  # compressed with its index: without one, read through
        last = None
        from runner_fsm.audit.records import lenient_records

        for record in lenient_records(segment.path):
            last = record.get("step_id") if isinstance(record.get("step_id"), int) else last
        return last
    from runner_fsm.audit.seek import last_step_of  # the tail of a file, perhaps being written

    try:
        return last_step_of(segment.path)
    except OSError:
        return None


def rotated_ranges(segments: tuple[SegmentFile, ...]) -> tuple[tuple[int, int], ...]:
    """The (first, last) steps rotated away between the kept `segments` (by index)."""
    out = []
    if segments and segments[0].index > 0 and segments[0].first_step:  # segment 0 itself is gone
        out.append((0, segments[0].first_step - 1))
    for before, after in zip(segments, segments[1:]):
        if after.follows or after.first_step is None:
            continue
        end = last_step(before)
        start = 0 if end is None or end < 0 else end + 1
        if start <= after.first_step - 1:
            out.append((start, after.first_step - 1))
    return tuple(out)



