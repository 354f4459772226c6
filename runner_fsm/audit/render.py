"""How an audit record becomes one JSON line (DESIGN section 7), written in full.

A log written with the job's shape is compact on disk (`compact`, which renders its records
from the same pieces); written in full are its `job` records and logs without a shape. There
every record starts with the same header (`schema`, `run_id`, `seq`, `t_ns`, `dp_rank`,
`pcp_rank`, `event`, `step_id`) and goes on with its own fields. Of the header only `seq`,
`t_ns`, `event` and `step_id` change from record to record, so `RecordRenderer` fills them into
bytes made once per log and appends the fields rendered as their own object: the same line as
rendering the merged dict, without building that dict for every record (the audit of a vLLM
step writes three records, two of them right after a forward has evicted the CPU caches: each
object built there costs).

The fields may also come rendered already (`bytes`, one JSON object): the records a hot loop
writes again and again are bytes made once (`cached_body`, `compact.transition_body`) or
filled into a template made once (`BuffersTemplate`, compact), with no encoder call per
record. Each equals `dumps_record` of its fields (tests hold them to that).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from runner_fsm.pcp.fingerprint import BufferFingerprint

try:  # orjson is optional: several times faster, same output shape
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


def _to_json_native(obj: Any) -> Any:
    """`default` hook: `Fingerprints`, NumPy/torch scalars and arrays, tuple subclasses, enums."""
    if type(obj) is Fingerprints:
        return obj.fields()
    if isinstance(obj, enum.Enum):
        return obj.value
    if hasattr(obj, "tolist"):  # numpy scalar/array, torch tensor
        return obj.tolist()
    if isinstance(obj, tuple):  # orjson refuses tuple subclasses such as torch.Size
        return list(obj)
    raise TypeError(f"audit log cannot serialise {type(obj).__qualname__}: {obj!r}")


def _dumps_orjson(record: Mapping[str, Any]) -> bytes:
    return orjson.dumps(record, default=_to_json_native, option=orjson.OPT_SERIALIZE_NUMPY)


# One encoder for the process: json.dumps with options builds a fresh encoder per call,
# which costs more than the encoding itself.
_STDLIB_ENCODER = json.JSONEncoder(default=_to_json_native, separators=(",", ":"), allow_nan=False)


def _dumps_stdlib(record: Mapping[str, Any]) -> bytes:
    return _STDLIB_ENCODER.encode(record).encode()


dumps_record = _dumps_orjson if orjson is not None else _dumps_stdlib


class RecordRenderer:
    """The lines of one log's records: `line(seq, t_ns, event, step_id, fields)`.

    `fields` must not repeat a header key (the record builders refuse those); then the line
    is exactly `dumps_record` of the whole record. `bytes` fields are taken as rendered.
    """

    def __init__(self, schema: int, run_id: str, dp_rank: int, pcp_rank: int):
        # "%" in the run id is escaped by rendering it first, then formatting the template.
        self._head = (b'{"schema":%d,"run_id":' % int(schema) + dumps_record(str(run_id)).replace(b"%", b"%%")
                      + b',"seq":%%d,"t_ns":%%d,"dp_rank":%d,"pcp_rank":%d,"event":%%b,"step_id":%%b,'
                      % (int(dp_rank), int(pcp_rank)))
        self._events: dict[str, bytes] = {}

    # For a log written in full: `full_body(event, fields)` renders a compact body (bytes, or a
    # rendered transition's (body, tail)) as the record's fields in full (`records.plain_lines`
    # sets it). None: bytes are taken as rendered.
    full_body = None

    def line(self, seq: int, t_ns: int, event: str, step_id: int | None,
             fields: Mapping[str, Any] | bytes) -> bytes:
        name = self._events.get(event)
        if name is None:
            name = self._events[event] = dumps_record(event)
        step = b"null" if step_id is None else b"%d" % step_id
        body = fields if type(fields) is bytes else dumps_record(fields)
        if len(body) == 2:  # no fields: "{}"
            return (self._head % (seq, t_ns, name, step))[:-1] + b"}"
        return self._head % (seq, t_ns, name, step) + body[1:]

    def lines(self, seq: int, records, now: int) -> bytes:
        """`line` of each of `records` ((t_ns, event, step_id, fields), ...), numbered from
        `seq`, joined by newlines, with `now` for a t_ns of None: `line`'s steps inline, one
        call for a whole batch (a vLLM step writes one record before its forward and two or
        three after it)."""
        head, events, out, full = self._head, self._events, [], self.full_body
        for t_ns, event, step_id, fields in records:
            name = events.get(event)
            if name is None:
                name = events[event] = dumps_record(event)
            if type(fields) is dict:  # the usual record: one check, as before `full_body`
                body = dumps_record(fields)
            elif full is not None and (type(fields) is bytes or type(fields) is tuple):
                body = full(event, fields)
            else:
                body = fields if type(fields) is bytes else dumps_record(fields)
            line = head % (seq, t_ns or now, name, b"null" if step_id is None else b"%d" % step_id)
            out.append(line[:-1] + b"}" if len(body) == 2 else line + body[1:])
            seq += 1
        return out[0] if len(out) == 1 else b"\n".join(out)


_CACHE_LIMIT = 4096  # distinct bodies kept per cache; beyond that, rendered per record


def cached_body(cache: dict, key: Any, fields: Mapping[str, Any]) -> bytes:
    """`dumps_record(fields)`, kept in `cache` under `key` (which must determine `fields`)."""
    body = cache.get(key)
    if body is None:
        body = dumps_record(fields)
        if len(cache) < _CACHE_LIMIT:
            cache[key] = body
    return body


class BuffersTemplate:
    """Compact bodies (`compact`) of `buffers` records over a fixed list of 1-d buffers.

    `body(reason, values, extra=b"")`, `values` flat `(ptr, size, version, digest, rows)` per
    name in order, is `dumps_record({"b": reason, "buf": {name: [ptr, [size], version, digest,
    rows]}, **extra})` for int values (the record `{"reason", "buffers": {name: {"ptr", "shape",
    "version", "digest", "rows"}}}` in full), where `extra` is the rendered `,"key":value` tail
    of further fields: one `%` into bytes made once, instead of a dict per buffer and an encoder
    call per record. `shape` is the buffer's storage (what a graph reads), `rows` the rows this
    forward read.
    """

    def __init__(self, names: tuple[str, ...]):
        each = [dumps_record(str(name)).replace(b"%", b"%%") + b":[%d,[%d],%d,%d,%d]" for name in names]
        self._tail = b',"buf":{' + b",".join(each) + b"}"
        self._reasons: dict[str, bytes] = {}

    def body(self, reason: str, values: tuple[int, ...], extra: bytes = b"") -> bytes:
        head = self._reasons.get(reason)
        if head is None:
            head = b'{"b":' + dumps_record(str(reason))
            if len(self._reasons) < _CACHE_LIMIT:
                self._reasons[reason] = head
        return head + self._tail % values + extra + b"}"


def fingerprint_fields(fp: Any) -> dict[str, Any]:
    """{ptr, shape, version[, digest][, rows]} from a dict, an object with those attributes, or a tensor.

    `digest` (a hash of the bytes, DESIGN section 7) is written when the fingerprint has one.
    """
    if type(fp) is BufferFingerprint:  # the common case first: no protocol checks
        out = {"ptr": fp.ptr, "shape": list(fp.shape), "version": fp.version}
        if fp.digest is not None:
            out["digest"] = fp.digest
        return out
    digest = rows = None
    if isinstance(fp, Mapping):
        ptr, shape, version, digest, rows = fp["ptr"], fp["shape"], fp["version"], fp.get("digest"), fp.get("rows")
    elif hasattr(fp, "data_ptr"):  # a torch tensor: its storage address and in-place counter
        ptr, shape, version = fp.data_ptr(), fp.shape, fp._version
    else:
        ptr, shape, version, digest = fp.ptr, fp.shape, fp.version, getattr(fp, "digest", None)
    out = {"ptr": int(ptr), "shape": [int(d) for d in shape], "version": int(version)}
    if digest is not None:
        out["digest"] = int(digest)
    if rows is not None:  # the rows a forward read, where `shape` is the buffer's whole storage
        out["rows"] = int(rows)
    return out


class Fingerprints:
    """A `buffers` record's buffers as they were handed over: two or more BufferFingerprints
    under str names, int ptrs and tuple shapes (the embedded engine's, every step; `snapshot`
    tells). Rendered where the record is: in full as {name: `fingerprint_fields(fp)`} (the
    encoders' `default` hook), compact from the tuples themselves (`compact`), without the dict
    per buffer that compact rendering only took apart again (~5 us an embedded step)."""

    __slots__ = ("of",)

    def __init__(self, of: dict[str, BufferFingerprint]):
        self.of = of  # a copy of the caller's dict: its tuples cannot change, the dict could

    def fields(self) -> dict[str, dict[str, Any]]:
        """The buffers as a `buffers` record holds them otherwise."""
        return {name: fingerprint_fields(fp) for name, fp in self.of.items()}

    def __eq__(self, other: Any) -> bool:  # equal tuples <=> equal fields, so either compares
        if type(other) is Fingerprints:
            return self.of == other.of
        return self.fields() == other if isinstance(other, Mapping) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def compact(self, listed: bool) -> dict[str, Any]:
        """`buf`, `p0` and `v` as `buffer_entries` writes them of `fields()` (every ptr an int
        and two or more buffers: `p0` always), from the tuples: an entry is a tuple (the same
        JSON as a list), with its version where not every buffer has the same one and its digest
        where it has one (a BufferFingerprint has no rows). `listed`: the entries alone."""
        fps = self.of.values()
        base = version = None
        shared = True
        for ptr, _, this, _ in fps:
            if base is None:
                base, version = ptr, this
            else:
                if ptr < base:
                    base = ptr
                if shared and not this == version:
                    shared = False
        if shared:
            entries = [(ptr - base, shape) if digest is None else (ptr - base, shape, digest)
                       for ptr, shape, _, digest in fps]
        else:
            entries = [(ptr - base, shape, this) if digest is None else (ptr - base, shape, this, digest)
                       for ptr, shape, this, digest in fps]
        out = {"buf": entries if listed else dict(zip(self.of, entries)), "p0": base}
        if shared:
            out["v"] = version
        return out


def snapshot(fingerprints: Mapping[str, Any]) -> dict[str, Any] | Fingerprints:
    """A `buffers` record's buffers as they are now: `Fingerprints` where they allow it, else
    {str(name): `fingerprint_fields(fp)`} (dicts, tensors, other objects)."""
    if type(fingerprints) is dict and len(fingerprints) > 1:
        for name, fp in fingerprints.items():
            if type(fp) is not BufferFingerprint or type(name) is not str or type(fp.ptr) is not int \
                    or type(fp.shape) is not tuple:
                break
        else:
            return Fingerprints(dict(fingerprints))
    return {str(name): fingerprint_fields(fp) for name, fp in fingerprints.items()}


def buffer_entries(buffers: dict | Fingerprints, names: tuple | None) -> dict:
    """`buf` (and `p0`, `v`) of a compact buffers record (`compact`'s docstring): plain loops, and a
    buffer with a digest alone as a tuple (the same JSON; generators cost ~3 us a record)."""
    if type(buffers) is Fingerprints:
        return buffers.compact(names is not None and tuple(buffers.of) == names)
    fps = list(buffers.values())
    listed = names is not None and tuple(buffers) == names
    base = None
    if len(fps) > 1:
        for fp in fps:
            ptr = fp["ptr"]
            if type(ptr) is not int:
                base = None
                break
            if base is None or ptr < base:
                base = ptr
    if base is None:  # one buffer, or a ptr that is not an int
        entries = [_buffer_entry(fp) for fp in fps]
        return {"buf": entries if listed else dict(zip(buffers, entries))}
    version, shared = fps[0]["version"], True
    for fp in fps:
        if not fp["version"] == version:
            shared = False
            break
    entries = [(fp["ptr"] - base, fp["shape"], fp["digest"]) if shared and len(fp) == 4 and "digest" in fp
               else _buffer_entry(fp, base, shared) for fp in fps]  # {ptr, shape, version, digest}: `_buffer_entry`'s
    out = {"buf": entries if listed else dict(zip(buffers, entries)), "p0": base}
    if shared:
        out["v"] = version
    return out


def _buffer_entry(fp: dict, base: int = 0, shared: bool = False) -> list:
    out = [fp["ptr"] - base, fp["shape"]] if shared else [fp["ptr"] - base, fp["shape"], fp["version"]]
    if "digest" in fp or "rows" in fp:
        out.append(fp.get("digest"))
    if "rows" in fp:
        out.append(fp["rows"])
    return out
