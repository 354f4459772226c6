"""Compact records read back in full (the encoding: `compact`).

`Expander` follows one segment record by record, from its `job` record (or from the first
record of a step, after a seek: `resume`): the step, seq and time a record does not repeat,
the open collective a `done` closes, the state a transition leaves, the buffers a graph replay
reads again. Called as is it fills a record in place with what replay reads (the header fields
the `job` record holds stay out); `full` gives the record of DESIGN section 7, every field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner_fsm.audit.compact import CHUNKINGS, DEST, FORWARD, INPUTS_FIELDS, NAMES_FIELD, ONLY_SOURCE, SAME
from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, FIELDS as DECISION_FIELDS

_NEW_STEP = object()  # not a step's first record
_NO_ROWS = object()  # a buffer logged without `rows`
# A `buffers` record as replay reads it: {name: (ptr, shape, version, digest, rows)}, the tuples
# `checks.BufferTracker` judges, under this key instead of `buffers` (built without a dict per
# buffer: a third of a compact record's expansion); `full` gives the logged form back.
FINGERPRINTS = "fingerprints"
_UNKNOWN = (None, None, None, None)  # a done whose enqueue was not read (a seek)
_EVENT_FIELDS = {"transition": ("trigger", "src", "dst", "outcome"), "buffers": ("reason", "buffers"),
                 "collective": ("group", "op", "phase", "shapes", "pg_seq", "stage"), "graph": ("action",),
                 "fault": ("error", "message")}


class Expander:
    """Records of one compact segment back in full (DESIGN section 7): call it with each record
    after the segment's `job` record, in file order (or from the first record of a step)."""

    def __init__(self, job: Mapping[str, Any]):
        self._head = {"schema": job.get("schema"), "run_id": job.get("run_id")}
        self._ranks = {"dp_rank": job.get("dp_rank"), "pcp_rank": job.get("pcp_rank")}
        self.t0 = job.get("t_ns") or 0
        names = job.get(NAMES_FIELD)
        self._names = tuple(names) if isinstance(names, list) else ()
        self.seq = (job.get("seq") or 0) + 1
        self.step: Any = None
        self._step_t = self.t0
        self._open: dict[Any, tuple] = {}  # group -> (op, phase, pg_seq, shapes)
        self.state: str | None = None  # the last transition's dst (None: not known)
        self._last_buffers: tuple = (None, {})  # (step, buffers) of the last buffers record

    def resume(self) -> None:
        """The next record is read after a jump in the file: it begins a step; what came
        before it (the last transition's dst, open collectives, times) is not known."""
        self._open.clear()
        self.state = None
        self._last_buffers = (None, {})

    def __call__(self, record: dict) -> dict:
        """`record` in full but for the header fields its segment's `job` record holds
        (`schema`, `run_id`, `dp_rank`, `pcp_rank`: see `full`), filled in place: what replay
        reads, per line, so it builds nothing it does not need (the most frequent first)."""
        collective = self.lean(record)
        if collective is not None:
            group, op, phase, pg_seq, shapes, stage = collective
            record["event"], record["group"], record["op"], record["phase"] = "collective", group, op, phase
            record["shapes"], record["pg_seq"], record["stage"] = shapes, pg_seq, stage
        return record

    def lean(self, record: dict) -> tuple | None:
        """`record` filled in place as `__call__` fills it, but for a collective's own fields:
        those come back as (group, op, phase, pg_seq, shapes, stage), for the scanner to take
        without reading them back out of the record (a collective is most records of a run);
        None for any other record."""
        if "event" in record:  # a record in full (the `job` record of the segment)
            return None
        if "s" in record:  # a step's first record
            self.step = step = record.pop("s")
            seq = record.pop("q")
            self._step_t = t_ns = self._step_t + record.pop("t") * 1000
        else:
            step, seq = self.step, self.seq
            t_ns = self._step_t + record.pop("t") * 1000 if "t" in record else self._step_t
        self.seq = seq + 1
        record["seq"], record["t_ns"], record["step_id"] = seq, t_ns, step
        done = record.pop("d", None)
        if done is not None or "c" in record:  # a collective: its done, or its enqueue
            if done is None:
                group, op, phase, pg_seq, shapes = record.pop("c")
                self._open[group], stage = (op, phase, pg_seq, shapes), "enqueue"
            elif type(done) is list:
                (group, op, phase, pg_seq, shapes), stage = done, "done"
            else:
                group, stage = done, "done"
                op, phase, pg_seq, shapes = self._open.pop(group, _UNKNOWN)
            if len(record) > 3:  # fields of its own: some are compact
                self._dispatch(record, step, phase)
            return group, op, phase, pg_seq, shapes, stage
        edge = record.pop("tr", None)
        if edge is not None:
            if type(edge) is str:  # as the table says, from the last transition's dst
                src = self.state if self.state is not None else ONLY_SOURCE.get(edge)
                record["event"], record["trigger"], record["src"], record["dst"] = "transition", edge, src, DEST.get(edge)
                record["outcome"] = "ok"
            else:
                record["event"], record["trigger"], record["src"], record["dst"] = "transition", edge[0], edge[1], edge[2]
                record["outcome"] = edge[3] if len(edge) > 3 else "ok"
            self.state = record["dst"]
            if "dg" in record:  # a step's decisions, on its `finish`
                record[DIGEST_FIELD] = record.pop("dg")
                changed = record.pop("dc", None)
                if changed is not None:  # by position, null where unchanged (`compact`)
                    record[DECISIONS_FIELD] = changed if type(changed) is dict else {
                        name: value for name, value in zip(DECISION_FIELDS, changed) if value is not None}
        elif "b" in record:
            fingerprints = self._fingerprints(record, step)
            record["event"], record["reason"], record[FINGERPRINTS] = "buffers", record.pop("b"), fingerprints
        elif "g" in record:
            record["event"], record["action"] = "graph", record.pop("g")
            if record["action"] == "replay" and "num_tokens" not in record:  # the open forward's rows
                op, _, _, shapes = self._open.get(FORWARD[0], _UNKNOWN)
                if op == FORWARD[1] and shapes:
                    record["num_tokens"] = shapes[0][0]
        elif "f" in record:
            record["error"], record["message"] = record.pop("f")
            record["event"] = "fault"
        else:
            record["event"] = record.pop("e", None)
        return None

    def full(self, record: dict) -> dict:
        """`record` in full: every header field, in the order a record in full has them."""
        record = self(record)
        if "schema" in record:  # the `job` record
            return record
        event = record.pop("event")
        if FINGERPRINTS in record:
            record["buffers"] = _logged(record.pop(FINGERPRINTS))
        out = {**self._head, "seq": record.pop("seq"), "t_ns": record.pop("t_ns"), **self._ranks, "event": event,
               "step_id": record.pop("step_id")}
        for name in _EVENT_FIELDS.get(event, ()):  # the event's own fields first, as its builder writes them
            out[name] = record.pop(name)
        out.update(record)
        return out

    def _fingerprints(self, record: dict, step) -> dict:
        buf, base, version = record.pop("buf"), record.pop("p0", 0), record.pop("v", None)
        if buf == SAME:  # the step's previous buffers record's (its tuples are never changed)
            last_step, last = self._last_buffers
            return last if last_step == step else {}
        out = {}
        for name, fp in (zip(self._names, buf) if type(buf) is list else buf.items()):
            if version is None:  # [ptr, shape, version(, digest(, rows))]
                more = len(fp) - 3
                out[name] = (fp[0] + base, fp[1], fp[2], fp[3] if more > 0 else None, fp[4] if more > 1 else _NO_ROWS)
            else:  # [ptr, shape(, digest(, rows))], the version the record's
                more = len(fp) - 2
                out[name] = (fp[0] + base, fp[1], version, fp[2] if more > 0 else None, fp[3] if more > 1 else _NO_ROWS)
        self._last_buffers = (step, out)
        return out

    @staticmethod
    def _dispatch(record: dict, step, phase) -> None:
        """The compact fields of a collective back in full (a DP agreement's, then a forward's,
        the most frequent first)."""
        values = record.pop("ag", None)
        if values is not None:
            own = values[5:] if len(values) > 5 else (step, phase)
            record["agreed"] = {"step_id": own[0], "phase": own[1], "num_tokens_across_dp": values[0],
                                "graph_mode": values[1], "uniform_token_count": values[2], "num_reqs": values[3],
                                "all_idle": bool(values[4])}
        values = record.pop("sn", None)
        if values is not None:
            own = values[5:] if len(values) > 5 else (step, phase)
            record["sent"] = {"step_id": own[0], "phase": own[1], "status": values[0], "num_tokens": values[1],
                              "graph_mode": values[2], "uniform_token_count": values[3], "num_reqs": values[4]}
        values = record.pop("in", None)
        if values is not None:
            record["inputs"] = inputs = dict(zip(INPUTS_FIELDS, values))
            if type(inputs.get("chunking")) is int:  # its place in CHUNKINGS (earlier logs: the name)
                inputs["chunking"] = CHUNKINGS[inputs["chunking"]]
        if "batch" in record:
            for name in ("batch", "ctx"):
                identity = record.get(name)
                if type(identity) is list:  # [dummy, rows, digest(, step)]
                    record[name] = {"step": identity[3] if len(identity) > 3 else step, "dummy": bool(identity[0]),
                                    "rows": identity[1], "digest": identity[2]}
                elif type(identity) is dict and "step" not in identity:  # an earlier writer's
                    record[name] = {"step": step, **identity}
            if record.get("ctx") == SAME:
                record["ctx"] = dict(record["batch"])
        values = record.pop("out", None)
        if values is not None:
            record["output"] = {"digest": values[0], "tokens": values[1]}


def _logged(fingerprints: dict) -> dict:
    """{name: {ptr, shape, version[, digest][, rows]}}: the buffers as they were logged."""
    out = {}
    for name, (ptr, shape, version, digest, rows) in fingerprints.items():
        entry = out[name] = {"ptr": ptr, "shape": shape, "version": version}
        if digest is not None:
            entry["digest"] = digest
        if rows is not _NO_ROWS:
            entry["rows"] = rows
    return out
