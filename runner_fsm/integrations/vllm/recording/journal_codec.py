"""The step journal on disk: each entry says only what changed since the entry before it.

Consecutive steps repeat most of what the journal says of them (the batch's scheduled tokens,
its forwards, the hashes of inputs that did not change), which took more bytes a step than the
audit log beside it (issue 53: 343 B against 220). So a journal segment (format 2) begins with
a header line, `{"journal":2}`, and every line after it is one entry as its differences from the
entry before it in that segment (the first: from nothing). An entry is read as its leaves: the
values under its keys, and under the keys of a dict or of each dict of a list of dicts inside it
(`inputs[0].seq_lens`: a forward's input hash), each found by its path. A line holds:
- each leaf that changed or is new, under its path the first time the segment names that path,
  then under the path's number (paths numbered from 0 as the segment first names them), as a
  string: `{"7":[[404],[489]],"9":2882878668}`;
- `-`: the leaves gone since the entry before (their numbers, or paths never numbered);
- nothing for a leaf unchanged, nor for a `step` one more than the entry before's;
- or `!`: the entry whole, where its fields' order is not the one its differences would give
  (a field back after a step without it) or its keys are not names.
A leaf is any value but a non-empty dict whose keys are names (no `.`, `[`, `]`, not `-`, `!`
or digits alone), or a non-empty list of such dicts. A segment without the header (a journal
written before format 2) is read line by line as it is. `Encoder` writes, `decode` reads back
exactly: the same entries, their fields in the same order (test_journal_codec.py);
`journal_encoder.Encoder` writes it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

FORMAT = 2
HEADER = orjson.dumps({"journal": FORMAT}) + b"\n"
WHOLE, GONE = "!", "-"
_NOT_IN_NAMES = re.compile(r"[.\[\]]|^\d+$|^[-!]$")
_PATH_PART = re.compile(r"\[(\d+)\]|\.?([^.\[\]]+)")


_NAMES: set[str] = set()  # keys known to be names: the same few, every step (a set test in C)


def _all_names(keys) -> bool:
    if keys <= _NAMES:
        return True
    if not all(type(key) is str and key and _NOT_IN_NAMES.search(key) is None for key in keys):
        return False
    if len(_NAMES) < 4096:
        _NAMES.update(keys)
    return True


def _is_branch(value: Any) -> bool:
    """A dict of names, or a list of them: its leaves are read one by one."""
    if type(value) is dict:
        return bool(value) and _all_names(value.keys())
    return type(value) is list and bool(value) and type(value[0]) is dict \
        and all(type(item) is dict and _is_branch(item) for item in value)


def leaves(entry: dict) -> dict[str, Any] | None:
    """{path: value} of an entry's leaves, in order; None where its own keys are not names."""
    if not _all_names(entry.keys()):
        return None
    out: dict[str, Any] = {}
    _flatten(entry, "", out)
    return out


def _flatten(node: dict, prefix: str, out: dict) -> None:
    for key, value in node.items():
        path = prefix + key
        kind = type(value)
        if (kind is not dict and kind is not list) or not _is_branch(value):
            out[path] = value
        elif kind is dict:
            _flatten(value, path + ".", out)
        else:
            for i, item in enumerate(value):
                _flatten(item, f"{path}[{i}].", out)


def entry_of(flat: dict[str, Any]) -> dict:
    """The entry whose leaves are `flat` (`leaves`' inverse)."""
    root: dict = {}
    for path, value in flat.items():
        parts = [int(m[1]) if m[1] is not None else m[2] for m in _PATH_PART.finditer(path)]
        node: Any = root
        for part, following in zip(parts, parts[1:]):
            if type(part) is int:
                if part == len(node):
                    node.append({})
                node = node[part]
            else:
                node = node.setdefault(part, [] if type(following) is int else {})
        node[parts[-1]] = value
    return root


def _same(a: Any, b: Any) -> bool:
    # JSON values: 1, 1.0 and true are equal in Python, never on disk
    return a == b and (type(a) is type(b) and type(a) in (int, str, float) or orjson.dumps(a) == orjson.dumps(b))


def _next_step(previous: Any) -> Any:
    return previous + 1 if type(previous) is int else None


class _Paths:
    """A segment's path numbers, the same for its writer and its readers."""

    def __init__(self) -> None:
        self.number: dict[str, int] = {}
        self.path: list[str] = []

    def name(self, path: str) -> str:
        """The key a leaf goes under; numbers the path the first time."""
        number = self.number.get(path)
        if number is not None:
            return str(number)
        self.number[path] = len(self.path)
        self.path.append(path)
        return path

    def read(self, key: str) -> str:
        if key.isdigit():
            return self.path[int(key)]
        self.name(key)
        return key


def decode(data: bytes) -> Iterator[tuple[dict, int]]:
    """(entry, bytes of its line) for each line of a journal segment's `data`, either format."""
    lines = data.splitlines(keepends=True)
    if not lines or lines[0] != HEADER:
        for raw in lines:
            if raw.strip():
                yield orjson.loads(raw), len(raw)
        return
    paths, previous = _Paths(), {}
    for raw in lines[1:]:
        line = orjson.loads(raw)
        if WHOLE in line:
            entry = line[WHOLE]
            previous = leaves(entry) or {}
            yield entry, len(raw)
            continue
        flat = dict(previous)
        for key in line.pop(GONE, ()):
            del flat[paths.path[key] if type(key) is int else key]
        written = set()
        for key, value in line.items():
            path = paths.read(key)
            written.add(path)
            flat[path] = value
        if "step" in flat and "step" not in written and _next_step(previous["step"]) is not None:
            flat["step"] = previous["step"] + 1
        previous = flat
        yield entry_of(flat), len(raw)

