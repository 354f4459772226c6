"""The one rule that names the replica out of order in a DP agreement (`agree.order`), and
`dp.agree` raising with it: a phase past the last a step of the job has names its sender (when
the drafter's K is known), else a majority decides, else the side ahead in (step, phase, sequence)
order, else it is a tie and nobody is named."""

from __future__ import annotations

import dataclasses

import pytest

from runner_fsm.agree.order import AHEAD, BEYOND, MAJORITY, TIE, last_phase, out_of_order
from runner_fsm.dp import DRAFT_DECODE, DRAFT_PREFILL, TARGET, LocalDispatch, agree
from runner_fsm.errors import DesyncError


def test_equal_keys_name_nobody():
    assert out_of_order({0: (5, TARGET), 1: (5, TARGET)}) is None


@pytest.mark.parametrize("culprit", [0, 1])
def test_two_replicas_the_one_ahead_skipped(culprit):
    # the culprit skipped its step-5 draft agreement: it sends step 6 TARGET where its peer
    # still sends step 5 DRAFT_PREFILL; no majority, the order decides
    sent = {culprit: (6, TARGET), 1 - culprit: (5, DRAFT_PREFILL)}
    found = out_of_order(sent)
    assert (found.culprits, found.step, found.basis) == ((culprit,), 5, AHEAD)
    assert found.describe().startswith(f"culprit: replica {culprit} at step 5 (no majority")
    assert f"odd one(s) out: replica(s) {culprit}" in found.describe()


def test_same_step_the_later_phase_is_ahead():
    found = out_of_order({0: (5, TARGET), 1: (5, DRAFT_DECODE)})
    assert (found.culprits, found.step, found.expected) == ((1,), 5, (5, TARGET))


def test_sequence_number_orders_within_a_phase():
    found = out_of_order({0: (5, TARGET, 12), 1: (5, TARGET, 11)})
    assert (found.culprits, found.step, found.basis) == ((0,), 5, AHEAD)


@pytest.mark.parametrize("culprit", [0, 2])
def test_three_replicas_the_majority_decides(culprit):
    sent = {r: (4, DRAFT_PREFILL) for r in range(3)}
    sent[culprit] = (5, TARGET)
    found = out_of_order(sent)
    assert (found.culprits, found.step, found.basis) == ((culprit,), 4, MAJORITY)


def test_a_replica_behind_the_majority_is_named_too():
    # a repeat: the majority decides even though the culprit is behind, not ahead
    found = out_of_order({0: (4, DRAFT_PREFILL), 1: (4, TARGET), 2: (4, DRAFT_PREFILL)})
    assert (found.culprits, found.step) == ((1,), 4)


def test_two_against_two_the_side_ahead():
    found = out_of_order({0: (6, TARGET), 1: (5, DRAFT_PREFILL), 2: (6, TARGET), 3: (5, DRAFT_PREFILL)})
    assert (found.culprits, found.step, found.basis) == ((0, 2), 5, AHEAD)
    assert found.describe().startswith("culprit: replicas 0, 2 at step 5")


def test_three_keys_without_majority_is_a_tie():
    found = out_of_order({0: (6, TARGET), 1: (5, DRAFT_PREFILL), 2: (5, TARGET)})
    assert (found.culprits, found.step, found.basis) == ((), None, TIE)
    assert found.describe().startswith("no culprit: a tie")


def test_a_phase_the_order_does_not_know_is_a_tie():
    # same step, different phases, one of which has no place in the order: never guessed
    found = out_of_order({0: (5, 9), 1: (5, DRAFT_PREFILL)})
    assert found.tie and found.culprits == () and "replica 0 sent step 5 phase 9" in found.describe()


@pytest.mark.parametrize("culprit", [0, 1])
def test_agree_names_the_culprit_of_a_two_replica_desync(culprit):
    columns = [LocalDispatch(5, DRAFT_PREFILL), LocalDispatch(5, DRAFT_PREFILL)]
    columns[culprit] = LocalDispatch(6, TARGET, num_tokens=3)
    with pytest.raises(DesyncError) as caught:
        agree(columns)
    assert (caught.value.culprits, caught.value.culprit_step) == ((culprit,), 5)
    message = str(caught.value)
    assert f"culprit: replica {culprit} at step 5" in message
    assert f"odd one(s) out: replica(s) {culprit}" in message
    assert f"odd one(s) out: replica(s) {1 - culprit}" not in message


def test_agree_reports_a_tie_without_a_culprit():
    columns = [LocalDispatch(6, TARGET), LocalDispatch(5, DRAFT_PREFILL), LocalDispatch(5, TARGET)]
    with pytest.raises(DesyncError, match="no culprit: a tie") as caught:
        agree(columns)
    assert caught.value.culprits == () and caught.value.culprit_step is None
    assert "odd one" not in str(caught.value)


def test_the_last_phase_of_a_step_follows_from_k():
    assert [last_phase(k) for k in (0, 1, 2, 5)] == [TARGET, DRAFT_PREFILL, DRAFT_DECODE, DRAFT_DECODE]


@pytest.mark.parametrize("culprit", [0, 1])
def test_an_extra_draft_pass_is_named_by_the_phase_past_the_steps_last(culprit):
    """Mutation: drop rule 0 (`_beyond`) from `out_of_order` -> the peer is named (AHEAD)."""
    # K = 1: the culprit ran a draft decode pass at step 5 (vllm-ascend #12036) and met its
    # peer's step-6 TARGET; the peer is ahead, yet it did nothing wrong
    sent = {culprit: (5, DRAFT_DECODE, 11), 1 - culprit: (6, TARGET, 11)}
    found = out_of_order(sent, last_phase=DRAFT_PREFILL)
    assert (found.culprits, found.step, found.basis) == ((culprit,), 5, BEYOND)
    assert found.describe().startswith(f"culprit: replica {culprit} at step 5 (it sent step 5 DRAFT_DECODE seq 11")
    assert out_of_order(sent).culprits == (1 - culprit,)  # the order alone bets on a skip


def test_rule_zero_needs_a_phase_past_the_last_on_some_replicas_only():
    sent = {0: (5, DRAFT_DECODE), 1: (6, TARGET)}
    assert out_of_order(sent, last_phase=DRAFT_DECODE).basis == AHEAD  # K > 1: DRAFT_DECODE is a step's own
    both = {0: (5, DRAFT_DECODE), 1: (5, DRAFT_DECODE, 3)}
    assert out_of_order(both, last_phase=DRAFT_PREFILL).basis == AHEAD  # every replica past it: no odd one
