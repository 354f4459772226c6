"""The step journal's writer (format 2, `journal_codec`), cheap on vLLM's step thread.

The format's own encoder (flatten every entry to its leaves, compare leaf by leaf in Python) cost
12 us an entry against 0.7 for one `orjson.dumps` (issue 53); vLLM renders the journal on its
step thread. Here each field is serialised on its own and compared with the same field of the
entry before as bytes; the fields that did not change in the entry before are serialised
together, as one; and only a field that changed and holds leaves of its own (`inputs`) is taken
leaf by leaf, in C where it can (`_Branch`). The lines are the format's: `journal_codec.decode`
reads them, and test_journal_codec.py pins both.
"""

from __future__ import annotations

from itertools import compress
from operator import itemgetter, ne
from typing import Any

import orjson

from runner_fsm.integrations.vllm.recording.journal_codec import (
    GONE, WHOLE, _all_names, _flatten, _is_branch, _Paths, _same)


class Encoder:
    """One journal segment's lines: `HEADER`, then `line(entry)` for each entry in order.

    Cheap on vLLM's step thread (issue 53: per leaf in Python it cost 12 us an entry): the fields
    that did not change in the entry before are serialised together, once, and compared with
    theirs as bytes; so is each other field (`default`, `option`: orjson's, for values that are
    not JSON yet). Only a field that changed and holds leaves of its own (`inputs`: a forward's
    input hashes) is read back and taken leaf by leaf, in C where it has the keys and value types
    of the one before (`_Branch`). The lines are the format's (the module's docstring): the
    entry as the decoder knows it is kept here a field at a time."""

    def __init__(self, default: Any = None, option: int | None = None) -> None:
        self._paths = _Paths()
        self._default, self._option = default, option
        self._order: list[str] = []  # the entry before's fields, in order
        self._fields: dict[str, tuple[bytes, _Branch | None]] = {}  # each one's JSON, and leaves
        self._step_next: bytes | None = None  # the JSON of its step plus one (a step that is an int)
        self._steady: tuple[Any, bytes, list[str]] = (None, b"", [])  # see `_regroup`
        self._prefixes: dict[str, bytes] = {}  # see `_prefix`

    def line(self, entry: dict) -> bytes:
        """The line of `entry`; a TypeError (a value orjson cannot serialise) changes nothing."""
        keys = list(entry)
        if keys == self._order:
            line = self._same_fields(entry, keys)
            if line is not None:
                return line
        elif not _all_names(entry.keys()):
            line = orjson.dumps({WHOLE: entry}, self._default, self._option)
            self._order, self._fields, self._steady, self._step_next = [], {}, (None, b"", []), None
            return line + b"\n"
        default, option = self._default, self._option
        line = self._fields_moved(keys, [orjson.dumps(value, default, option) for value in entry.values()])
        self._regroup(entry, keys, set(keys))
        step = self._fields.get("step")
        self._step_next = _following(step[0]) if step is not None and step[1] is None else None
        return line

    def _regroup(self, entry: dict, keys: list[str], changed: set[str]) -> None:
        """Group the fields that did not change (`changed`: those that did) for the next entry:
        one getter, their JSON together, and the others; a step is always among the others."""
        steady = [key for key in keys if key not in changed and key != "step"]
        if len(steady) < 2:
            self._steady = (None, b"", keys)
            return
        getter = itemgetter(*steady)
        self._steady = (getter, orjson.dumps(getter(entry), self._default, self._option),
                        [key for key in keys if key in changed or key == "step"])

    def _same_fields(self, entry: dict, keys: list[str]) -> bytes | None:
        """The line where the entry has the fields of the one before, in the same order and each
        with the same leaves (the usual step); None where not (and nothing changed here)."""
        dumps, default, option = orjson.dumps, self._default, self._option
        steady, steady_raw, check = self._steady
        if steady is None or dumps(steady(entry), default, option) != steady_raw:
            check = keys
        fields, prefix, step_next = self._fields, self._prefix, self._step_next
        parts: list[bytes] = []  # `"<path or its number>":<JSON>`, in the order they are named
        changed = []
        for key in check:
            raw = dumps(entry[key], default, option)
            before_raw, before = fields[key]
            if raw == before_raw:
                if step_next is None or key != "step":
                    continue  # unchanged (a step the same as the one before is not: written)
            elif raw == step_next and key == "step":  # one more: implied
                changed.append((key, (raw, None)))
                step_next = b"%d" % (int(raw) + 1)
                continue
            first = raw[0]
            if first != 123 and (first != 91 or raw[1] != 123) or raw == b"{}":  # a leaf: not {.. nor [{..
                if before is not None:
                    return None
                parts.append(prefix(key) + raw)
                changed.append((key, (raw, None)))
                if key == "step":
                    step_next = _following(raw)
                continue
            if before is None:
                return None
            ints = before.ints(raw) if before.names is not None else None
            if ints is not None:  # the same keys, each an int: compared, and written, as bytes
                flags = list(map(ne, ints, before.raws))
                parts += map(bytes.__add__, compress(before.names, flags), compress(ints, flags))
                changed.append((key, (raw, _Branch(before.paths, None, before.shape, before.types, before.names,
                                                   before.template, ints))))
                continue
            branch = before.next(value := orjson.loads(raw))
            if branch is None:
                if not _is_branch(value) or (branch := _Branch.of(key, value)).paths != before.paths:
                    return None
                flags = [not _same(a, b) for a, b in zip(before.values, branch.values)]
                branch.names = before.names
            else:
                flags = list(map(ne, branch.values, before.values))
            parts += [prefix(path) + orjson.dumps(leaf) for path, leaf in zip(compress(branch.paths, flags),
                                                                              compress(branch.values, flags))]
            if branch.names is None:
                branch.learn_names(self._paths)
            if key == "step":
                step_next = None
            changed.append((key, (raw, branch)))
        fields.update(changed)
        self._step_next = step_next
        if check is keys or len(check) - len(changed) > 1:  # the group changed, or could grow
            self._regroup(entry, keys, {key for key, _ in changed})
        return b"{" + b",".join(parts) + b"}\n"

    def _prefix(self, path: str) -> bytes:
        """`"<path>":` the first time the segment names it, `"<its number>":` from then on."""
        known = self._prefixes.get(path)
        if known is not None:
            return known
        name = self._paths.name(path)
        self._prefixes[path] = b'"%d":' % self._paths.number[path]
        return orjson.dumps(name) + b":"

    def _fields_moved(self, keys: list[str], encoded: list[bytes]) -> bytes:
        """The line where fields came, went or changed their leaves: as the format says, on the
        leaves of the whole entry and the whole entry before (`_Leaf`: a field that is one)."""
        fields = self._fields
        now = {}
        for key, raw in zip(keys, encoded):
            field = fields.get(key)
            if field is None or field[0] != raw:
                value = orjson.loads(raw) if raw[:2] == b"[{" or raw[:1] == b"{" and raw != b"{}" else None
                field = (raw, _Branch.of(key, value) if value is not None and _is_branch(value) else None)
            now[key] = field
        flat, previous = _flat(now), _flat({key: fields[key] for key in self._order})
        self._order, self._fields = keys, now
        same_paths = flat.keys() == previous.keys()
        if (list(flat) != list(previous) if same_paths else
                [p for p in previous if p in flat] + [p for p in flat if p not in previous] != list(flat)):
            return orjson.dumps({WHOLE: {key: orjson.Fragment(raw) for key, raw in zip(keys, encoded)}}) + b"\n"
        out: dict[str, Any] = {}
        name, missing = self._paths.name, out
        for path, value in flat.items():
            before = previous.get(path, missing)
            if path == "step" and before is not missing:
                following = _following(before.raw) if type(before) is _Leaf else None
                if following is not None and type(value) is _Leaf and value.raw == following:
                    continue  # one more: implied
                if following is None and _same_leaf(before, value):
                    continue  # unchanged, and not a number one more
            elif before is not missing and _same_leaf(before, value):
                continue
            out[name(path)] = orjson.Fragment(value.raw) if type(value) is _Leaf else value
        if not same_paths and (gone := [self._paths.number.get(path, path) for path in previous if path not in flat]):
            out[GONE] = gone
        for _, branch in now.values():
            if branch is not None and branch.names is None:
                branch.learn_names(self._paths)
        return orjson.dumps(out) + b"\n"


_PLAIN = frozenset((int, str, bool, type(None)))  # values whose == is their JSON's (not float: -0.0)


class _Branch:
    """A field's leaves: their paths and values; and where it is a dict or a list of dicts of plain
    values (`inputs`), its keys (`shape`) and its values' types, so that the next one with the same
    is compared in C (`next`); where those values are ints, its JSON around them (`template`), so
    that the next is compared without reading it (`ints`); `names`: each path's `"<number>":` in the
    segment, once all have one."""

    __slots__ = ("paths", "_values", "shape", "types", "names", "template", "raws")

    def __init__(self, paths: tuple, values: list | None, shape: Any = None, types: Any = None,
                 names: Any = None, template: Any = None, raws: Any = None):
        self.paths, self._values, self.shape, self.types, self.names = paths, values, shape, types, names
        self.template, self.raws = template, raws

    @property
    def values(self) -> list:
        if self._values is None:
            self._values = list(map(int, self.raws))
        return self._values

    @classmethod
    def of(cls, key: str, value: Any) -> "_Branch":
        leaves: dict[str, Any] = {}
        _flatten({key: value}, "", leaves)
        values = list(leaves.values())
        shape, plain = _shape_and_values(value)
        types = list(map(type, values))
        if shape is None or plain != values or not _PLAIN.issuperset(types):
            return cls(tuple(leaves), values)
        branch = cls(tuple(leaves), values, shape, types)
        if set(types) == {int}:
            branch.template = _template(orjson.dumps(value), values)
            branch.raws = [b"%d" % number for number in values] if branch.template else None
        return branch

    def ints(self, raw: bytes) -> list[bytes] | None:
        """The JSON of each value where `raw` is this template's with other digits in its values."""
        if self.template is None:
            return None
        prefixes, suffixes = self.template
        parts = raw.split(b",")
        if len(parts) != len(prefixes):
            return None
        ints = list(map(bytes.removesuffix, map(bytes.removeprefix, parts, prefixes), suffixes))
        # each part its prefix, an int, its suffix: a prefix or suffix left in is not digits, and
        # JSON of nothing but digits and minus signs is ints
        return ints if b"".join(ints).translate(None, b"-").isdigit() else None

    def next(self, value: Any) -> "_Branch | None":
        """The same field's leaves in `value`, where it has the same keys and value types."""
        if self.shape is None:
            return None
        if type(value) is list and len(value) == 1 and type(item := value[0]) is dict:  # one forward
            shape, values = (tuple(item),), list(item.values())
        else:
            shape, values = _shape_and_values(value)
        if shape != self.shape or list(map(type, values)) != self.types:
            return None
        return _Branch(self.paths, values, shape, self.types, self.names, self.template,
                       [b"%d" % number for number in values] if self.template else None)

    def learn_names(self, paths: _Paths) -> None:
        numbers = [paths.number.get(path) for path in self.paths]
        if None not in numbers:
            self.names = [b'"%d":' % number for number in numbers]


def _template(raw: bytes, values: list[int]) -> tuple | None:
    """The JSON of a dict or list of dicts of ints around its ints: split at its commas, each part
    a prefix (`[{"input_ids":`), the int, a suffix (`}]`); None where its keys hold a comma."""
    parts = raw.split(b",")
    if len(parts) != len(values):
        return None
    prefixes, suffixes = [], []
    for part, number in zip(parts, values):
        body = part.rstrip(b"}]")
        digits = b"%d" % number
        if not body.endswith(digits):
            return None
        prefixes.append(body[:-len(digits)])
        suffixes.append(part[len(body):])
    return prefixes, suffixes


def _shape_and_values(value: Any) -> tuple[Any, Any]:
    """A dict's keys and values, or a list of dicts' keys (each's) and values (all); Nones if not."""
    try:
        if type(value) is dict:
            return tuple(value), list(value.values())
        return tuple(map(tuple, value)), [leaf for item in value for leaf in item.values()]
    except (TypeError, AttributeError):
        return None, None


class _Leaf:
    """A field that is a leaf, by its JSON (`Encoder._fields_moved`)."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes):
        self.raw = raw


def _flat(fields: dict[str, tuple[bytes, _Branch | None]]) -> dict[str, Any]:
    """{path: value} of the leaves of an entry's `fields` (a leaf field: `_Leaf`)."""
    out: dict[str, Any] = {}
    for key, (raw, branch) in fields.items():
        if branch is None:
            out[key] = _Leaf(raw)
        else:
            out.update(zip(branch.paths, branch.values))
    return out


def _same_leaf(a: Any, b: Any) -> bool:
    if type(a) is _Leaf or type(b) is _Leaf:
        return type(a) is type(b) and a.raw == b.raw
    return _same(a, b)


def _following(raw: bytes) -> bytes | None:
    """The JSON of an int one more than the int whose JSON is `raw`; None where it is no int."""
    if raw.isdigit() or raw[:1] == b"-" and raw[1:].isdigit():
        return b"%d" % (int(raw) + 1)
    return None
