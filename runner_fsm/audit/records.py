"""Reading an audit file back, record by record, in full (DESIGN section 7).

A file is read as it was written: in full (schema 1, or a log written without the job's
shape), or compact (`compact`: its `job` record says so; every record comes back with the
header that record carries, the rest filled from the segment's `job` record). Either way a
log still open, or whose process died, ends in a blank tail (`mapped`), where reading stops.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from runner_fsm.audit.compact import is_compact
from runner_fsm.audit.compress import open_lines
from runner_fsm.audit.expand import Expander
from runner_fsm.audit.mapped import is_blank, rest_is_blank
from runner_fsm.audit.render import dumps_record
from runner_fsm.errors import RunnerError

TIME_FIELDS = ("t_ns",)
_NO_HEADER = {"t_ns": 0}


class AuditLogFormatError(RunnerError, ValueError):
    """An audit log line is not a JSON object."""


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield each record of one audit file (one segment of a capped log) in full; strict: any
    bad line raises with file:line. The records end at a blank tail (a log still open, or
    whose process died: `audit.mapped`)."""
    expand = None
    with open_lines(Path(path)) as lines:
        for line_no, line in enumerate(lines, start=1):
            if is_blank(line):
                if rest_is_blank(lines):  # the unwritten tail of a log that was not closed
                    return
                raise AuditLogFormatError(f"{path}:{line_no}: blank line inside the audit log")
            try:
                record = json.loads(line)
            except ValueError as err:
                raise AuditLogFormatError(f"{path}:{line_no}: unparsable audit line: {err}") from err
            if not isinstance(record, dict):
                raise AuditLogFormatError(
                    f"{path}:{line_no}: audit line is a {type(record).__name__}, expected an object"
                )
            if line_no == 1 and is_compact(record):
                expand = Expander(record)
            elif expand is not None:
                try:
                    record = expand.full(record)
                except (LookupError, TypeError, ValueError) as err:
                    raise AuditLogFormatError(f"{path}:{line_no}: malformed compact record: {err!r}") from err
            yield record


def lenient_records(path: str | os.PathLike[str], offset: int = 0) -> Iterator[dict[str, Any]]:
    """The records of one audit file in full, unreadable lines skipped (replay reports those),
    to its blank tail. From byte `offset` (> 0: from the first step that begins there on; a
    compact record's step and times are known from there only)."""
    loads, bad = orjson.loads, orjson.JSONDecodeError
    with open_lines(Path(path)) as lines:
        expand = None
        try:
            first = loads(lines.readline())
        except bad:
            first = None
        if isinstance(first, dict):
            expand = Expander(first) if is_compact(first) else None
            if offset == 0:
                yield first
        if offset > 0:
            lines.seek(offset)
            lines.readline()  # the rest of a line that began before `offset`
            if expand is not None:
                expand.resume()
        started = offset == 0 or expand is None
        for raw in lines:
            if is_blank(raw):
                break  # the blank tail of a log that was not closed
            try:
                record = loads(raw)
                if expand is not None:
                    if not started and not raw.startswith(b'{"s":'):
                        continue  # a step's first record begins what can be read in full
                    started = True
                    record = expand.full(record)
            except (bad, LookupError, TypeError, ValueError):
                continue
            if isinstance(record, dict):
                yield record


def strip_times(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy without wall-clock fields, for comparing runs against a golden file."""
    return {key: value for key, value in record.items() if key not in TIME_FIELDS}


def plain_fields(event: str, body: bytes) -> dict[str, Any]:
    """A compact record body (`compact.transition_body`, `render.BuffersTemplate`) as the
    fields of the record in full, for a log written in full."""
    record = Expander(_NO_HEADER).full({"s": None, "q": 0, "t": 0, **orjson.loads(body)})
    if record["event"] != event:
        raise ValueError(f"a rendered {event} record holds a {record['event']} body")
    return {key: value for key, value in record.items() if key not in _HEADER}


_HEADER = frozenset({"schema", "run_id", "seq", "t_ns", "dp_rank", "pcp_rank", "event", "step_id"})


_PLAIN_LIMIT = 4096  # compact bodies kept in full per log; beyond that, converted per record


def plain_lines(renderer):
    """`renderer.lines` for a log written in full: compact bodies (`rendered`) in full first.

    Each distinct body is converted once per log and kept: a transition is one of a few bodies
    written step after step, and converting one (parse, expand, render again) cost ~4.5 us, twice
    a step, on top of a list of every record rebuilt per write (bench_bookkeeping, CPU: 35 us a
    step at 097b734, 50 with the conversion per record). The renderer converts inline
    (`RecordRenderer.full_body`); a record whose fields are a dict costs what it did before. A
    rendered transition's tail (a step's decisions) differs step by step: converted each time."""
    kept: dict[tuple[str, bytes], bytes] = {}

    def full_body(event: str, fields) -> bytes:
        if type(fields) is tuple:  # `rendered_transition`: the body and its tail, as one body
            return dumps_record(plain_fields(event, fields[0][:-1] + fields[1] + b"}"))
        body = kept.get((event, fields))
        if body is None:
            body = dumps_record(plain_fields(event, fields))
            if len(kept) < _PLAIN_LIMIT:
                kept[(event, fields)] = body
        return body

    renderer.full_body = full_body
    return renderer.lines
