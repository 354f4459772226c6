"""A `finish` record written from rendered bytes (`compact.decisions_tail` through
`rendered_transition`, the vLLM recorder's path) is the record `transition(..., decided=...)`
writes from dicts (the embedded replica's path): byte for byte, in both log formats."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from runner_fsm.audit import AuditLog
from runner_fsm.audit.compact import decisions_tail, transition_body
from runner_fsm.audit.decisions import FIELDS, DecisionChanges, DecisionLog, StepDecisions
from runner_fsm.audit.shape import job_shape_fields


def _steps(seed: int) -> list[StepDecisions]:
    """Decode runs (nothing changes), batches that change one or several fields, idle steps
    (a dummy: zeros), a change in the last field alone, and numbers that are not ints."""
    rng = random.Random(seed)
    steps, batch = [], 7
    for i in range(60):
        roll = rng.random()
        if roll < 0.15:
            steps.append(StepDecisions(False, 0, 0, rng.choice((0, 4)), rng.choice((0, 4)), 0, 0))
            continue
        if roll < 0.4:
            batch = rng.randrange(1, 2**32)
        draft = 1 if i == 30 else 0  # the last field changing alone: no trailing null
        steps.append(StepDecisions(True, batch, rng.choice((3, 5)), 8, rng.choice((0, 8)), draft,
                                   rng.randrange(2**32)))
    steps.append(StepDecisions(True, np.int64(5), np.int32(3), 8, 8, 0, 9))  # numpy numbers: the encoder's path
    return steps


def _values(decided: StepDecisions) -> tuple:
    return tuple(decided.fields()[name] for name in FIELDS)


@pytest.mark.parametrize("compact", (False, True), ids=("full", "compact"))
def test_a_rendered_finish_is_the_finish_written_from_dicts(tmp_path, compact):
    """Mutation seen to fail this: `DecisionChanges.changed` keeping trailing nulls (or
    `decisions_tail` writing `dc` when nothing changed) -> the bytes differ."""
    shape = job_shape_fields(2, 1, 0, 0) if compact else None
    steps = _steps(seed=11)
    with AuditLog(tmp_path / "dicts", "run-d", 0, 0, 0, shape=shape) as dicts:
        log = DecisionLog()
        for step, decided in enumerate(steps):
            dicts.transition(step, "decode", "ready", "decode", "ok")
            dicts.transition(step, "finish", "decode", "ready", "ok", log.entry(decided))
    with AuditLog(tmp_path / "rendered", "run-d", 0, 0, 0, shape=shape) as rendered:
        changes = DecisionChanges()
        finish = transition_body("finish", "decode", "ready", "ok")
        for step, decided in enumerate(steps):
            rendered.transition(step, "decode", "ready", "decode", "ok")
            tail = decisions_tail(decided.digest(), changes.changed(_values(decided)))
            rendered.rendered_transition(step, finish, tail)
    strip = lambda line: re.sub(rb'"t(_ns)?":-?\d+,?', b"", line)  # noqa: E731  the times differ
    want = [strip(line) for line in dicts.path.read_bytes().splitlines() if b'"event":"job"' not in line]
    got = [strip(line) for line in rendered.path.read_bytes().splitlines() if b'"event":"job"' not in line]
    assert got == want and len(got) == 2 * len(steps)
    assert b'"dc"' in b"".join(got) if compact else b'"decisions"' in b"".join(got)


def test_what_changed_is_each_decision_against_the_step_before():
    """By position (`DecisionChanges`) and by name (`DecisionLog`), against the previous step's
    decisions worked out here. Mutation seen to fail this: `changed` comparing with the first
    step's values instead of the last one's -> a decision that changed back reads as unchanged."""
    log, changes, before = DecisionLog(), DecisionChanges(), None
    for decided in _steps(seed=5)[:-1]:
        now = _values(decided)
        if before is None:
            expected = list(now)
        else:
            expected = [value if value != then else None for value, then in zip(now, before)]
            while expected and expected[-1] is None:
                expected.pop()
        expected = expected or None
        before = now
        digest, by_name = log.entry(decided)
        assert changes.changed(now) == expected
        assert by_name == (None if expected is None else
                           {name: value for name, value in zip(FIELDS, expected) if value is not None})
        assert digest == decided.digest()


def test_a_rendered_transition_must_be_a_transition_and_a_tail():
    """Mutation seen to fail this: `rendered_transition` without its check of the body and the
    tail -> no ValueError, a malformed line would be written."""
    with pytest.raises(ValueError, match="rendered transition"):
        AuditLog.rendered_transition(None, 3, b'{"b":"real"}', b',"dg":1')
    with pytest.raises(ValueError, match="rendered transition"):
        AuditLog.rendered_transition(None, 3, b'{"tr":"finish"}', b'"dg":1')
