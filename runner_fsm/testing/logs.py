"""Reading and editing audit logs in tests, whatever their encoding (`audit.compact`).

A test that removes or changes records reads them in full (`read_records`) and writes them back
in full (`rewrite_in_full`): a log in full is a log replay reads, as logs were first written,
so a compact log edited this way stays a valid log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import orjson

from runner_fsm.audit.compact import FORMAT_FIELD
from runner_fsm.audit.records import read_records

_RANK_FILES = re.compile(r"^(?:rank-(\d+)(?:\.\d+)?\.jsonl(?:\.idx|\.gz(?:\.tmp)?)?|vllm-steps-(\d+)(?:\.\d+)?\.jsonl"
                         r"|fr-rank-(\d+)\.json)$")


def files_bytes(run_dir: str | os.PathLike[str]) -> dict[int, int]:
    """{global rank: bytes its files take now}: its log's segments (plain, compressed, being
    compressed) and their step indexes, its vLLM step journal, its Flight Recorder dump (what
    `max_log_bytes` caps)."""
    run_dir, out = Path(run_dir), {}
    for name in os.listdir(run_dir) if run_dir.exists() else ():
        match = _RANK_FILES.match(name)
        if match:
            rank = int(next(g for g in match.groups() if g is not None))
            try:
                out[rank] = out.get(rank, 0) + os.stat(run_dir / name).st_size
            except FileNotFoundError:  # rotated away while we looked
                pass
    return out


def records_of(path: str | os.PathLike[str]) -> list[dict]:
    """The records of one audit file, in full."""
    return list(read_records(path))


def write_in_full(path: str | os.PathLike[str], records: list[dict]) -> None:
    """`records` (in full) as an audit file in full."""
    for record in records:
        record.pop(FORMAT_FIELD, None)  # a job record no longer begins a compact log
    Path(path).write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))


def rewrite_in_full(path: str | os.PathLike[str], edit: Callable[[list[dict]], list[dict]]) -> None:
    """Replace the file's records with `edit(records)` (in full), written in full."""
    write_in_full(path, edit(records_of(path)))
