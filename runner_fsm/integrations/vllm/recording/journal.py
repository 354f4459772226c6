"""What vLLM decided per step, one compact JSON line per step: `<run_dir>/vllm-steps-<rank>.jsonl`
(and, under a log cap, `vllm-steps-<rank>.<k>.jsonl`: segment k of the audit log's, deleted with it).

The audit log (`rank-<global_rank>.jsonl`, DESIGN section 7) keeps the schema that replay
judges; its record types have no field for vLLM's own decisions, so those go here, keyed by
the same step ids: the scheduled requests and token counts, new/resumed/finished requests,
scheduled draft tokens, per forward (real or dummy) the graph mode, batch descriptor and DP
token counts, the sampled tokens, and the drafter's proposals. Lines are buffered (this file
is for diagnosis; the audit log, on disk per record, is the evidence a crash leaves behind):
entries are kept as they are and rendered `BATCH` at a time, then written to the file's buffer,
which goes to disk when full and at shutdown. Rendering costs thread CPU inside vLLM, whose own
work evicts the encoder between two steps; a batch of entries renders with it warm after its
first one (`journal_encoder`: each entry serialised a field at a time, no JSON round trip). For the same reason an entry holds
vLLM's scheduler output itself, and a field whose value vLLM resolves after the step (`Later`):
both are read when the entry is rendered. On disk each entry says only what changed since the
one before it in its segment (`journal_codec`, format 2); `read_journal` gives them back whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import orjson

from runner_fsm.audit.segments import segment_name
from runner_fsm.integrations.vllm.recording import journal_codec
from runner_fsm.integrations.vllm.recording.journal_encoder import Encoder

OPTIONS = orjson.OPT_SERIALIZE_NUMPY
BATCH = 32  # entries rendered together; a process killed loses at most these (and the buffer)


def journal_path(run_dir: str, global_rank: int, segment: int = 0) -> Path:
    return Path(run_dir) / segment_name("vllm-steps", global_rank, segment)


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "name"):  # enums (graph modes)
        return obj.name
    if hasattr(obj, "_asdict"):  # namedtuples (a forward's input hashes, `probe.InputHashes`)
        return obj._asdict()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"journal cannot serialise {type(obj).__qualname__}")


class Later:
    """A field's value that exists only after the step (an async output vLLM's engine resolves
    later): `getattr(source, attr)` when the entry is rendered; the field is left out if that
    is empty or missing then."""

    __slots__ = ("source", "attr")

    def __init__(self, source: Any, attr: str):
        self.source, self.attr = source, attr


def _resolved(entry: dict) -> dict:
    """The entry as it is written: the scheduler output's fields (`step_entry`) in its place,
    each `Later` field's value, or nothing."""
    if SCHEDULED not in entry and not any(type(value) is Later for value in entry.values()):
        return entry
    out = {}
    for key, value in entry.items():
        if key == SCHEDULED:
            out.update(_scheduled(value))
        elif type(value) is Later:
            if (value := getattr(value.source, value.attr, None) or None) is not None:
                out[key] = value
        else:
            out[key] = value
    return out


def _line(encoder: Encoder, entry: dict) -> bytes:
    """One entry's line; an entry that cannot be rendered becomes one that says so (its step and
    the error), and the others of its batch are kept."""
    try:
        return encoder.line(_resolved(entry))
    except TypeError as error:
        return encoder.line({"step": entry.get("step"), "journal_error": str(error)})


class Journal:
    def __init__(self, run_dir: str, global_rank: int):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run_dir, self.global_rank = run_dir, int(global_rank)
        self.path = journal_path(run_dir, global_rank)
        self._open()
        self.pending: list[dict] = []  # entries not rendered yet (their callers no longer change them)

    # -- a companion of the audit log's segments (`audit.segments.Companion`)

    def segment_path(self, index: int) -> Path:
        return journal_path(self.run_dir, self.global_rank, index)

    def rotate(self, index: int) -> None:
        """The audit log switched to segment `index`: entries go to its journal from now on."""
        if not self._file.closed:
            self.close()
            self.path = self.segment_path(index)
            self._open()

    def _open(self) -> None:
        self._file = open(self.path, "xb")
        self._file.write(journal_codec.HEADER)
        self._encoder = Encoder(_default, OPTIONS)  # each segment reads on its own

    def size(self) -> int:
        """Bytes of the current segment so far, those buffered included (`Companion`)."""
        return 0 if self._file.closed else self._file.tell()

    def write(self, entry: dict) -> None:
        pending = self.pending
        pending.append(entry)
        if len(pending) >= BATCH:
            self.render()

    def render(self) -> None:
        """Render what `pending` holds into the file's buffer."""
        pending = self.pending
        if pending:
            encoder = self._encoder
            lines = b"".join([_line(encoder, entry) for entry in pending])
            pending.clear()
            self._file.write(lines)

    def flush(self) -> None:
        if not self._file.closed:
            self.render()
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.render()
            finally:
                self._file.close()


def read_journal(run_dir: str, global_rank: int = 0) -> list[dict]:
    """Every entry the rank's journal still holds, its segments in order, whole (either format)."""
    return [entry for path in journal_segments(run_dir, global_rank)
            for entry, _ in journal_codec.decode(path.read_bytes())]


def journal_segments(run_dir: str | os.PathLike[str], global_rank: int = 0) -> list[Path]:
    """The rank's journal segments still on disk, in order."""
    pattern = re.compile(rf"^vllm-steps-{int(global_rank)}(?:\.(\d+))?\.jsonl$")
    found = sorted((int(m[1] or 0), name) for name in os.listdir(run_dir) if (m := pattern.match(name)))
    return [Path(run_dir) / name for _, name in found]


SCHEDULED = "scheduler_output"  # an entry's key for vLLM's scheduler output, as it is (`step_entry`)


def step_entry(so: Any, step: int, kind: str) -> dict:
    """A step's journal entry as it begins: the step, its kind, and what vLLM's scheduler
    decided for it (the recorder adds to it as the step runs). The scheduler output is read when
    the entry is rendered (`_scheduled`: vLLM's scheduler makes a new one each step and changes
    none after), except its scheduled drafts, counted now: a drafter may take some out of it
    during the step (vLLM's GPU n-gram proposer)."""
    spec = so.scheduled_spec_decode_tokens
    return {"step": step, "kind": kind, SCHEDULED: so, "spec": sum(map(len, spec.values())) if spec else 0}


def _scheduled(so: Any) -> dict:
    """What a journal entry says of vLLM's scheduler output, compactly."""
    return {"tokens": so.total_num_scheduled_tokens, "sched": list(so.num_scheduled_tokens.values()),
            "new": len(so.scheduled_new_reqs), "resumed": len(so.scheduled_cached_reqs.resumed_req_ids),
            "finished": len(so.finished_req_ids)}
