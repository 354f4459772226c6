"""The compact encoding of audit records on disk (schema 2, `record_format: compact`).

A log written with the job's shape (every log the runner and the vLLM worker write) begins
each segment with its `job` record, in full: the run id, the rank's coordinates, the schema,
the time base. Every other record says only what is its own, in short keys:

    {"s":12,"q":340,"t":5120,"tr":["decode","ready","decode"]}    the first record of step 12
    {"t":210,"c":["dp","all_reduce",1,12,[[9,2]]],"sent":{...}}    the next ones
    {"t":395,"d":"dp","ag":[[2,1],0,0,0,0]}

- `s`, `q`: step id and seq, on the first record of each step (any change of step id, null
  included); the records after it are seq q+1, q+2, ... (a lost line shows at the next step's
  `q`). `t`: microseconds, on a step's first record since the previous step's first record (the
  segment's first step: since its `job` record, whose `t_ns` is absolute), on the others since
  their step's first record. Each step's time is the previous one's plus its whole microseconds,
  for the writer as for a reader: a time reads back less than a microsecond early, however many
  steps the segment holds. Times are read from a segment's start (`read_records`, the trace
  export); a replay that seeks into a segment does not need them.
- the event, one key: `tr` a transition: its trigger alone when it went as the table says
  (outcome `ok`, from the previous transition's `dst` in this segment to the table's `dst`),
  else `[trigger, src, dst]` (outcome `ok`) or `[trigger, src, dst, outcome]`; `c` a collective's enqueue `[group, op, phase, pg_seq, shapes]`; `d` its
  done: the group's name when it closes that group's last open enqueue (op, phase, pg_seq and
  shapes are the enqueue's), else `[group, op, phase, pg_seq, shapes]`; `b` a buffers record's
  reason, with `buf`: {name: [ptr, shape, version(, digest(, rows))]} (digest null where only
  rows follow; a list of the entries alone where the names are, in order, the `buffer_names`
  the segment's `job` record declares), or with several buffers `p0` (the lowest ptr: each ptr is written less it) and,
  where every buffer has one, `v` (the version: left out of each entry), or `"buf":"="` for
  the very buffers of the step's previous `buffers` record (a graph replay's inputs, logged
  right after they were written); `g` a graph action, a replay's `num_tokens` left out where it
  is the rows of the forward it runs in (the open `expert` `forward`, shapes `[[rows]]`);
  `f` a fault `[error, message]`; `e` any other event, whose fields follow as they are.
- the record's other fields under their own names, except a DP agreement's `sent` (a
  `LocalDispatch`) as `sn`: [status, num_tokens, graph_mode, uniform_token_count, num_reqs] and
  its `agreed` (a `DPSyncState`) as `ag`: [num_tokens_across_dp, graph_mode,
  uniform_token_count, num_reqs, all_idle as 0/1], each followed by [step_id, phase] only where
  those differ from the record's own; a forward's context identity `ctx` as `"="` where it is
  its batch's (`batch`, the same record), and each identity as [dummy as 0/1, rows, digest],
  followed by its `step` only where that is not the record's (logs of an earlier writer: the
  identity as it is, less its `step` where that is the record's); a DP agreement's dispatch `inputs` as `in`: [decode, prefill, pcp, chunking(,
  decodes)], its `chunking` as its place in `CHUNKINGS` where it is one (earlier logs: the
  name); a step's `output` digest as `out`: [digest, tokens]; and, on a step's `finish`
  transition, its `decision_digest` as `dg` and its changed `decisions` as `dc`: their values in
  `decisions.FIELDS` order, null where unchanged, trailing nulls left out.

`expand.Expander` turns them back into the records of DESIGN section 7, every header field
filled from the segment's `job` record (what `read_records` and replay read). `CompactRenderer`
writes them; the bodies a hot loop renders once (`transition_body`, `BuffersTemplate` in `render`) are
compact already, and so is a `finish` transition's tail of decisions (`decisions_tail`, written with
its transition body by `rendered_transition`).
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter
from typing import Any

from runner_fsm.audit import step_lane
from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, FIELDS as DECISION_FIELDS
from runner_fsm.audit.render import buffer_entries, dumps_record
from runner_fsm.states.table import TRANSITIONS

FORMAT_FIELD, FORMAT = "record_format", "compact"  # in the `job` record of a compact log
# Keys of a compact record; a record's own fields may not use them.
KEYS = frozenset({"s", "q", "t", "tr", "c", "d", "b", "buf", "p0", "v", "g", "f", "e", "ag", "sn", "in", "out",
                  "dg", "dc"})
NAMES_FIELD = "buffer_names"  # in the `job` record: the buffers a `buffers` record lists, in order
INPUTS_FIELDS = ("decode", "prefill", "pcp", "chunking", "decodes")  # `checks.dispatch_inputs`
CHUNKINGS = ("ceil", "balanced", "mrv2")  # `pcp.layout.POLICIES` on disk, by place: only ever appended to
IDENTITY_FIELDS = ("step", "dummy", "rows", "digest")  # `context_rule`
SAME = "="  # a value the record (or the step's previous buffers record) holds already
SENT_FIELDS = ("status", "num_tokens", "graph_mode", "uniform_token_count", "num_reqs")
AGREED_FIELDS = ("num_tokens_across_dp", "graph_mode", "uniform_token_count", "num_reqs", "all_idle")
_OUTPUT_KEYS = {"digest", "tokens"}  # `checks.output_digest`
_COLLECTIVE_FIELDS = frozenset({"group", "op", "phase", "shapes", "pg_seq", "stage"})
_TRANSITION_FIELDS = frozenset({"trigger", "src", "dst", "outcome"})
_NEW_STEP = object()  # no record yet in this segment: the next one starts a step
FORWARD = ("expert", "forward")  # the target forward's collective (`replica._forward`)
_REPLAY_KEYS = frozenset({"action", "num_tokens"})
# Each trigger has one destination in the table; some have one source too.
DEST = {t.trigger.value: t.dest.value for t in TRANSITIONS}
ONLY_SOURCE = {t.trigger.value: t.sources[0].value for t in TRANSITIONS if len(t.sources) == 1}
# transition body -> (src, dst, its short body or None), filled by `transition_body`
_EDGES: dict[bytes, tuple[str, str, bytes | None]] = {}


def is_compact(job: Mapping[str, Any] | None) -> bool:
    """Whether the log a `job` record begins is compact."""
    return job is not None and job.get(FORMAT_FIELD) == FORMAT


def transition_body(trigger: str, src: str, dst: str, outcome: str) -> bytes:
    """A transition's body, as `AuditLog.rendered` takes it (in full: the renderer writes the
    trigger alone where the record chains on and goes where the table says)."""
    body = dumps_record({"tr": [trigger, src, dst] if outcome == "ok" else [trigger, src, dst, outcome]})
    if body not in _EDGES and len(_EDGES) < 4096:
        short = dumps_record({"tr": trigger}) if outcome == "ok" and DEST.get(trigger) == dst else None
        _EDGES[body] = (src, dst, short)
    return body


# ---------------------------------------------------------------- writing


# Each value and then step_id and phase, by one `itemgetter` call: seven values of a dict of seven
# keys are its keys exactly (a KeyError otherwise), without comparing its keys to a set (~0.3 us)
_SENT_VALUES = itemgetter(*SENT_FIELDS, "step_id", "phase")
_AGREED_VALUES = itemgetter(*AGREED_FIELDS, "step_id", "phase")
_DISPATCH_KEYS = len(SENT_FIELDS) + 2  # the values and step_id, phase: as many for `agreed`
assert len(AGREED_FIELDS) == len(SENT_FIELDS)


def _dispatch(value: Any, step: Any, phase: Any, values: itemgetter) -> Any:
    """`sent`/`agreed` (`values`: `_SENT_VALUES` or `_AGREED_VALUES`) as their list (a tuple: the
    same JSON), or None to keep it as it is (name by name cost a microsecond more an agreement)."""
    if type(value) is not dict or len(value) != _DISPATCH_KEYS:
        return None
    try:
        out = values(value)
    except KeyError:
        return None
    if values is _AGREED_VALUES and type(out[4]) is bool:
        out = (*out[:4], int(out[4]), *out[5:])
    return out[:5] if out[5] == step and out[6] == phase else out


def _inputs(inputs: Any) -> list | None:
    """A dispatch's `inputs` as `in` (its keys are the first four of `INPUTS_FIELDS` or all five:
    as many keys as those, each there), or None to keep it as it is."""
    if type(inputs) is not dict or not 4 <= len(inputs) <= 5:
        return None
    try:
        values = [inputs["decode"], inputs["prefill"], inputs["pcp"], inputs["chunking"]]
        if len(inputs) == 5:
            values.append(inputs["decodes"])
    except KeyError:
        return None
    if values[3] in CHUNKINGS:
        values[3] = CHUNKINGS.index(values[3])
    return values


class CompactRenderer:
    """The lines of one segment's records after its `job` record, whose `t_ns` is `t0_ns`.

    Its step, the time of the step's first record and its last transition's `dst` live in
    `lane` (`step_lane.LaneState`: `step`, `step_t`, `state`), shared with the log; its own
    unless one is given."""

    def __init__(self, t0_ns: int, buffer_names=None, lane: Any = None):
        self.t0 = int(t0_ns)
        self._names = tuple(buffer_names) if buffer_names else None
        self.lane = lane = step_lane.LaneState() if lane is None else lane
        lane.step = _NEW_STEP  # the step of the last record written
        lane.step_t = self.t0
        lane.state = None  # the last transition's dst in this segment
        self._buffers: tuple = (None, None)  # (step, buffers) of the last buffers record
        self._open: dict[Any, tuple] = {}  # group -> (op, phase, pg_seq) of its last open enqueue
        self._rows: int | None = None  # the rows of the open forward (`FORWARD`), for its graph replay

    def lines(self, seq: int, records, now: int) -> bytes:
        """The lines of `records` ((t_ns, event, step_id, fields), ...) numbered from `seq`,
        joined by newlines; `now` for a t_ns of None. Inline, one call per write: it runs two or
        three times a vLLM step, each right after vLLM evicted the CPU caches."""
        lane = self.lane
        out, step, step_t = [], lane.step, lane.step_t
        try:
            for t_ns, event, step_id, fields in records:
                t = t_ns or now
                kind = type(fields)
                if event == "transition":  # rendered, with its own fields (a tuple), or a dict
                    body, tail = (fields, b"") if kind is bytes else fields if kind is tuple else _transition(fields)
                    out.append(self.transition(seq, step_id, t, body, tail)[:-1])
                    seq += 1
                    continue
                # `_head` and `_body`'s dispatch inline where they are one line (most of the 7
                # records of an embedded step: a call each cost more than the line)
                if step_id != lane.step or lane.step is _NEW_STEP:
                    head = self._head(seq, step_id, t)
                else:
                    head = b'{"t":%d,' % ((t - lane.step_t) // 1000)
                body = fields if kind is bytes else self._collective(step_id, fields) if event == "collective" \
                    else self._body(event, step_id, fields)
                out.append(head[:-1] + b"}" if len(body) == 2 else head + body[1:])
                seq += 1
        except BaseException:  # none of it is written: the next record starts its step anew
            lane.step, lane.step_t = step, step_t
            raise
        return out[0] if len(out) == 1 else b"\n".join(out)

    @property
    def step(self) -> Any:
        """The step of the last record written (`_NEW_STEP`: none yet in this segment)."""
        return self.lane.step

    def _head(self, seq: int, step_id, t: int) -> bytes:
        """A record's header: step, seq and time on its step's first record, else the time."""
        lane = self.lane
        if step_id != lane.step or lane.step is _NEW_STEP:
            gap = (t - lane.step_t) // 1000
            # The step's time as a reader rebuilds it (the previous one's plus whole microseconds):
            # each record is then off by less than a microsecond, and no error adds up over steps.
            lane.step, lane.step_t = step_id, lane.step_t + gap * 1000
            return b'{"s":%b,"q":%d,"t":%d,' % (b"null" if step_id is None else b"%d" % step_id, seq, gap)
        return b'{"t":%d,' % ((t - lane.step_t) // 1000)

    def transition(self, seq: int, step_id, t: int, body: bytes, tail: bytes = b"") -> bytes:
        """The line of one transition, its newline included (`body` rendered by `transition_body`,
        `tail` its own fields as `rendered_transition` takes them): the trigger alone where the
        record chains on and goes where the table says. One call for a vLLM step's start and for
        its `finish` (`AuditLog.step_transition`), each right after vLLM evicted the CPU caches."""
        head = self._head(seq, step_id, t)
        edge = _EDGES.get(body)
        if edge is not None:
            lane = self.lane
            if edge[2] is not None and edge[0] == lane.state:
                body = edge[2]
            lane.state = edge[1]
        if tail:
            return b"%b%b%b}\n" % (head, body[1:-1], tail)
        return b"%b%b\n" % (head, body[1:])

    def _body(self, event: str, step_id, fields: dict) -> bytes:
        if event == "collective":
            return self._collective(step_id, fields)
        if event == "buffers":  # {"b": reason, buf/p0/v, then any other field}: no copy of the fields
            buffers = fields["buffers"]
            same = self._buffers == (step_id, buffers)
            self._buffers = (step_id, buffers)
            out = {"b": fields["reason"]}
            out.update({"buf": SAME} if same else buffer_entries(buffers, self._names))
            if len(fields) > 2:
                out.update([(key, value) for key, value in fields.items() if key != "reason" and key != "buffers"])
            return dumps_record(out)
        if event == "graph":
            rest = dict(fields)
            if self._rows is not None and rest.keys() == _REPLAY_KEYS and rest["action"] == "replay" \
                    and rest["num_tokens"] == self._rows:
                del rest["num_tokens"]  # the forward's rows, on its enqueue
            return dumps_record({"g": rest.pop("action"), **rest})
        if event == "fault" and fields.keys() == {"error", "message"}:
            return dumps_record({"f": [fields["error"], fields["message"]]})
        return dumps_record({"e": event, **fields})

    def _collective(self, step_id, fields: dict) -> bytes:
        group, op, phase, pg_seq, stage = (fields["group"], fields["op"], fields["phase"], fields["pg_seq"],
                                           fields["stage"])
        if (group, op) == FORWARD:  # its graph replay's size, when it is one row count
            shapes = fields["shapes"]
            self._rows = shapes[0][0] if stage == "enqueue" and len(shapes) == 1 and len(shapes[0]) == 1 else None
        if stage == "enqueue":
            self._open[group] = (op, phase, pg_seq)
            head: dict = {"c": [group, op, phase, pg_seq, fields["shapes"]]}
        elif self._open.get(group) == (op, phase, pg_seq):  # closes the group's last enqueue
            del self._open[group]
            head = {"d": group}
        else:
            head = {"d": [group, op, phase, pg_seq, fields["shapes"]]}
        if len(fields) == 6:  # nothing of its own (most of a vLLM step's): no more to look at
            return dumps_record(head)
        # Each rule asked only where its field is there (generic loops cost ~1 us a record)
        fields = fields.copy()
        del fields["group"], fields["op"], fields["phase"], fields["shapes"], fields["pg_seq"], fields["stage"]
        if "sent" in fields:
            value = _dispatch(fields["sent"], step_id, phase, _SENT_VALUES)
            if value is not None:
                del fields["sent"]
                head["sn"] = value
        if "agreed" in fields:
            value = _dispatch(fields["agreed"], step_id, phase, _AGREED_VALUES)
            if value is not None:
                del fields["agreed"]
                head["ag"] = value
        if "inputs" in fields:
            values = _inputs(fields["inputs"])
            if values is not None:
                del fields["inputs"]
                head["in"] = values
        if "output" in fields:
            output = fields["output"]
            if type(output) is dict and output.keys() == _OUTPUT_KEYS:
                head["out"] = [fields.pop("output")["digest"], output["tokens"]]
        if "ctx" in fields or "batch" in fields:
            if "ctx" in fields and fields["ctx"] == fields.get("batch"):
                fields["ctx"] = SAME
            for name in ("ctx", "batch"):
                identity = fields.get(name)
                if type(identity) is dict and len(identity) == 4:  # its 4 keys, where each is there
                    try:
                        step, dummy = identity["step"], identity["dummy"]
                        values = [0, identity["rows"], identity["digest"]]
                    except KeyError:
                        continue
                    if type(dummy) is bool:
                        values[0] = int(dummy)
                        fields[name] = values if step == step_id else values + [step]
        head.update(fields)
        return dumps_record(head)


_BODIES: dict[tuple, bytes] = {}  # (trigger, src, dst, outcome) -> `transition_body`, for `_transition`


def _transition(fields: dict) -> tuple[bytes, bytes]:
    """A transition record's fields as (body, tail), as `CompactRenderer.transition` takes them:
    the tail holds a step's decisions on its `finish` (and any other field of its own). A body
    is rendered once per edge, a digest alone by `%d` as `decisions_tail` does (~2 us a step)."""
    key = (fields["trigger"], fields["src"], fields["dst"], fields["outcome"])
    body = _BODIES.get(key)
    if body is None:
        body = transition_body(*key)
        if len(_BODIES) < 4096:
            _BODIES[key] = body
    if len(fields) == 4:
        return body, b""
    if len(fields) == 5 and type(fields.get(DIGEST_FIELD)) is int:
        return body, b',"dg":%d' % fields[DIGEST_FIELD]
    return body, b"," + dumps_record(_decided(fields))[1:-1]


def decisions_tail(digest: int, changed: list | None) -> bytes:
    """A `finish` transition's own fields rendered, as `rendered_transition` takes them: what
    `_decided` renders of `{decision_digest: digest, decisions: ...}`, from `changed`, the
    decisions in `decisions.FIELDS` order, None where unchanged, trailing Nones left out (None:
    nothing changed). Ints by `%d` (one format per record, where the dict path builds two dicts
    and calls the encoder); anything else through `_decided` itself."""
    if not changed:
        return b',"dg":%d' % digest if type(digest) is int else b"," + dumps_record({"dg": digest})[1:-1]
    if type(digest) is int and all(type(v) is int or v is None for v in changed):
        return b',"dg":%d,"dc":[%b]' % (digest, b",".join([b"null" if v is None else b"%d" % v for v in changed]))
    decisions = {name: value for name, value in zip(DECISION_FIELDS, changed) if value is not None}
    return b"," + dumps_record(_decided({DIGEST_FIELD: digest, DECISIONS_FIELD: decisions}))[1:-1]


def _decided(fields: dict) -> dict:
    """A `finish` transition's decision digest and changed decisions as `dg` and `dc`, and any
    other field of its own as it is."""
    out = {key: value for key, value in fields.items() if key not in _TRANSITION_FIELDS}
    out["dg"] = out.pop(DIGEST_FIELD)
    changed = out.pop(DECISIONS_FIELD, None)
    if changed:  # by position in FIELDS, null where unchanged: a third of the bytes of the names
        values = [changed.get(name) for name in DECISION_FIELDS]
        while values[-1] is None:
            values.pop()
        out["dc"] = values if len(changed) == sum(v is not None for v in values) else changed
    return out
