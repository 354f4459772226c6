"""A step's digests compiled (`_step_lane.decide`): what `decisions.decide`, the reference,
gives, on what vLLM samples and on what it does not; used only once it agreed on the probes.
`make` builds it: a missing one fails here."""

from __future__ import annotations

import collections
import random

import pytest

from runner_fsm.audit import decisions, step_lane


def test_the_compiled_decide_is_built_checked_and_used():
    assert step_lane.decide is not None, step_lane.status()
    assert decisions.DECIDE is step_lane.decide and decisions.DECIDE_NOT_COMPILED is None


def _sampled(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return []
    if kind == 2:  # the embedded engine's form: by request id
        return {f"r{i}": [rng.randrange(50000) for _ in range(rng.randrange(1, 4))] for i in range(rng.randrange(3))}
    rows = []
    for _ in range(rng.randrange(1, 20)):
        row = [rng.choice([rng.randrange(-3, 3), rng.randrange(1 << 17), rng.randrange(1 << 70) - (1 << 69)])
               for _ in range(rng.randrange(0, 5))]
        rows.append(tuple(row) if kind == 4 else row)  # tuples, and lists
    if kind == 5:
        rows[0] = collections.deque(rows[0])  # anything tuple() takes
    return rows


def test_it_gives_what_the_reference_gives():
    """Mutations seen to fail this: the length term of the tuple hash left out; a token row's
    hash combined without its own tuple hash; the tail given where `last` differs in its last
    value; `sampled` of another form digested as a list (the process dies)."""
    rng = random.Random(7)
    for _ in range(3000):
        values = tuple(rng.choice([0, 1, rng.randrange(1 << 32), rng.randrange(64)]) for _ in range(6))
        last = rng.choice([None, values, (*values[:5], values[5] + 1), values[:3], tuple(values)])
        sampled = _sampled(rng)
        assert step_lane.decide(values, sampled, last) == decisions.decide(values, sampled, last), (values, sampled)


def test_a_tail_says_what_compact_renders_for_an_unchanged_step():
    from runner_fsm.audit.compact import decisions_tail

    tokens, digest, tail = step_lane.decide((1, 5, 16, 16, 0, 0), [[3], [4]], (1, 5, 16, 16, 0, 0))
    assert tail == decisions_tail(digest, None) and tokens == decisions.tokens_digest([[3], [4]])


def test_errors_reach_the_caller():
    class Unhashable:
        __hash__ = None

    with pytest.raises(TypeError):
        step_lane.decide((1, 2, 3, 4, 5, 6), [[Unhashable()]], None)
    with pytest.raises(TypeError):
        step_lane.decide([1, 2, 3, 4, 5, 6], None, None)


def test_a_compiled_decide_that_disagrees_is_not_used():
    """`checked` asks every probe: one wrong answer, or an error, and the reference decides."""
    def off_by_one(values, sampled, last):
        tokens, digest, tail = decisions.decide(values, sampled, last)
        return tokens, digest + (values == (1, 5, 1, 1, 0, 0) and sampled == [[2**61 - 1, 2**64 + 3]]), tail

    def failing(values, sampled, last):
        raise OverflowError("no")

    assert decisions.checked(decisions.decide) == (decisions.decide, None)
    for compiled, why in ((off_by_one, "gave"), (failing, "failed")):
        used, reason = decisions.checked(compiled)
        assert used is decisions.decide and why in reason
