"""The step journal's encoding on disk (`journal_codec`): each entry as its differences from the
one before, read back exactly (the same entries, their fields in the same order); a journal
written before the format (no header) still reads."""

from __future__ import annotations

import orjson

from runner_fsm.integrations.vllm.recording import journal_codec as codec
from runner_fsm.integrations.vllm.recording.journal_encoder import Encoder
from runner_fsm.integrations.vllm.recording.journal import Journal, journal_path, read_journal


def _decode_step(step: int, sampled: list, spec: int = 0) -> dict:
    return {"step": step, "kind": "decode", "tokens": 8, "sched": [1] * 8, "new": 0, "resumed": 0, "finished": 0,
            "spec": spec, "forwards": [["real", "NONE", [8, None, False], None]], "sampled": sampled,
            "inputs": [{"input_ids": 1000 + step, "positions": 2000 + step, "query_start_loc": 7, "block_table": 9}]}


# Every way an entry can differ from the one before: a step not one more (a gap, the same step,
# none), a field gone and back (out of order: written whole), a list of dicts growing and
# shrinking, values equal in Python but not in JSON (1, 1.0, true), keys that are not names,
# empty containers, nested dicts.
ENTRIES = [
    _decode_step(0, [[5]] * 8), _decode_step(1, [[6]] * 8), _decode_step(2, [[6]] * 8),
    _decode_step(5, [[7]] * 8), _decode_step(5, [[7]] * 8), {**_decode_step(6, [[1]]), "spec": 1.0},
    {**_decode_step(7, [[1]]), "spec": True}, {k: v for k, v in _decode_step(8, [[1]]).items() if k != "sampled"},
    _decode_step(9, [[2]]), {**_decode_step(10, [[2]]), "inputs": _decode_step(10, 0)["inputs"] * 2},
    {**_decode_step(11, [[2]]), "inputs": []}, {**_decode_step(12, [[2]]), "inputs": [{}]},
    {"step": None, "journal_error": "x"}, {"step": None, "journal_error": "x"}, {"step": 14, "0": 1, "a.b": 2},
    {"step": 15, "nested": {"a": {"b": [1, 2], "c": {}}, "d": [{"e": 1}, {"e": 2, "f": {"g": 3}}]}},
    {"step": 16, "nested": {"a": {"b": [1, 2], "c": {}}, "d": [{"e": 1}]}, "drafts": {"7": [1]}},
    {"step": True}, {"step": 1}, {},
]


def test_entries_read_back_exactly_fields_in_order():
    """Mutations seen to fail this: `_same` as `==` (1.0 read back as 1); the implicit step
    applied to a step not one more; the order check left out (a field back moves to the end)."""
    encoder = Encoder()
    data = codec.HEADER + b"".join(encoder.line(orjson.loads(orjson.dumps(e))) for e in ENTRIES)
    got = [entry for entry, _ in codec.decode(data)]
    assert got == ENTRIES
    assert [list(e.items()) for e in got] == [list(e.items()) for e in ENTRIES]
    assert [orjson.dumps(e) for e in got] == [orjson.dumps(e) for e in ENTRIES]  # types too


def test_a_decode_step_takes_what_changed_only():
    """A decode step after another: its sampled tokens and the input hashes that changed."""
    encoder = Encoder()
    first = orjson.loads(encoder.line(_decode_step(0, [[5]] * 8)))  # every path named, in full
    assert list(first)[-4:] == ["inputs[0].input_ids", "inputs[0].positions", "inputs[0].query_start_loc",
                                "inputs[0].block_table"]
    line = encoder.line(_decode_step(1, [[6]] * 8))
    assert len(line) < len(orjson.dumps(_decode_step(1, [[6]] * 8))) // 4
    assert orjson.loads(line) == {"9": [[6]] * 8, "10": 1001, "11": 2001}  # sampled, the two hashes


def test_a_journal_written_before_the_format_still_reads(tmp_path):
    """Mutation seen to fail this: `decode` taking every file for format 2."""
    journal_path(str(tmp_path), 0).write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in ENTRIES[:4]))
    assert read_journal(str(tmp_path)) == ENTRIES[:4]


def test_the_journal_writes_format_2_and_reads_it_back(tmp_path):
    journal = Journal(str(tmp_path), 0)
    for entry in ENTRIES:
        journal.write(entry)
    journal.close()
    assert journal_path(str(tmp_path), 0).read_bytes().startswith(codec.HEADER)
    assert read_journal(str(tmp_path)) == ENTRIES


def _inputs(step: int, **changes) -> dict:
    return {"step": step, "kind": "decode", "sampled": [[step]],
            "inputs": [{"input_ids": 1000 + step, "positions": 2000 + step, "block_table": 9, **changes}]}


# The encoder's cheap paths (fields compared as bytes, a group of those that did not change, the
# input hashes compared as the digits between their keys): every way the next entry can leave them.
CHEAP_PATHS = [
    _inputs(0), _inputs(1), _inputs(2), _inputs(3, block_table=-9), _inputs(4, block_table=10),
    _inputs(5, positions="1,2"), _inputs(6, positions='x":1'), _inputs(7), _inputs(8, positions=True),
    _inputs(9, positions=1.0), _inputs(10, positions=1), _inputs(11, **{"a,b": 1}), _inputs(12, **{"a,b": 2}),
    {**_inputs(13), "inputs": [{"input_ids": 1013, "block_table": 9, "positions": 2013}]},
    {**_inputs(14), "inputs": _inputs(14)["inputs"] * 2}, {**_inputs(15), "inputs": _inputs(15)["inputs"] * 2},
    {**_inputs(16), "inputs": {"input_ids": 1, "positions": 2}}, {**_inputs(17), "inputs": {"input_ids": 3, "positions": 2}},
    {**_inputs(18), "inputs": 5}, {**_inputs(19), "inputs": [{"input_ids": {"x": 1}}]},
    {**_inputs(20), "inputs": [{"input_ids": {"x": 2}}]}, {**_inputs(21), "kind": "prefill"}, {**_inputs(22), "kind": "x"},
    {**_inputs(23), "sampled": {"a": 1}}, {**_inputs(24), "sampled": [[1]]}, {**_inputs(25), "step": {"a": 25}},
    {**_inputs(26), "step": 26}, {**_inputs(27), "step": 26}, {**_inputs(28), "step": "x"}, {**_inputs(29), "step": "x"},
    {**_inputs(30), "step": 30}, _inputs(31), _inputs(32), {**_inputs(33), "inputs": []}, _inputs(34), _inputs(35),
    {**_inputs(36), "inputs": [{"input_ids": 1036, "POS": 2036, "block_table": 9}]}, _inputs(37), _inputs(38),
    _inputs(39, input_ids=-5), _inputs(40, input_ids=-6), _inputs(41, input_ids="-7"), _inputs(42, input_ids=-8),
]


def test_the_cheap_paths_read_back_exactly():
    """Mutation seen to fail this: `_Branch.ints` without its test that what lies between a
    template's prefix and suffix is digits (a key renamed: its line no JSON)."""
    encoder = Encoder()
    data = codec.HEADER + b"".join(encoder.line(orjson.loads(orjson.dumps(e))) for e in CHEAP_PATHS)
    got = [entry for entry, _ in codec.decode(data)]
    assert [orjson.dumps(e) for e in got] == [orjson.dumps(e) for e in CHEAP_PATHS]
    assert len(data) < sum(len(orjson.dumps(e)) for e in CHEAP_PATHS)  # differences, mostly
