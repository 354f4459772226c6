"""Naming a culprit from every rank's last position on a timeout (`heartbeat`): a replica outside
any collective while its peers wait; else the rule `dp.agree` names a desync's culprit by
(`agree.order`) over where each one waits."""

from __future__ import annotations

import pytest

from runner_fsm.config import ParallelLayout
from runner_fsm.agree.heartbeat import Position, describe_positions

AGREE, FORWARD = "dp all_reduce #9", "expert forward #12"


def _positions(layout, where):
    """`where`: replica -> (step, phase, collective) for every PCP rank of it."""
    return {rank: Position(rank, *where[rank // layout.pcp_size]) for rank in range(layout.world_size)}


@pytest.mark.parametrize("culprit", [0, 1])
def test_two_replicas_the_one_outside_is_named(culprit):
    layout = ParallelLayout(2, 2)
    where = {culprit: (4, 1, ""), 1 - culprit: (4, 1, FORWARD)}
    assert describe_positions(_positions(layout, where), layout).startswith(f"culprit: replica {culprit} (")


@pytest.mark.parametrize("culprit", [0, 1])
def test_two_replicas_waiting_the_one_ahead_is_named(culprit):
    layout = ParallelLayout(2, 1)
    where = {culprit: (4, 2, AGREE), 1 - culprit: (4, 1, FORWARD)}  # it skipped the forward
    assert describe_positions(_positions(layout, where), layout).startswith(f"culprit: replica {culprit} (")


@pytest.mark.parametrize("culprit", [0, 2])
def test_three_replicas_the_majority_decides_even_behind(culprit):
    layout = ParallelLayout(3, 1)
    where = {r: (4, 1, FORWARD) for r in range(3)}
    where[culprit] = (4, 1, AGREE)  # waits in an agreement the others are past: an extra one
    assert describe_positions(_positions(layout, where), layout).startswith(f"culprit: replica {culprit} (")


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_replica_waiting_in_a_phase_past_the_steps_last_is_named(culprit):
    """K = 1 (the last phase DRAFT_PREFILL): the culprit waits in a DRAFT_DECODE agreement its
    extra draft step entered, its peer finished the step and waits outside the worker.
    Mutation: drop the `beyond` rule from `_culprits` -> the peer, outside, is named."""
    layout = ParallelLayout(2, 2)
    where = {culprit: (4, 3, AGREE), 1 - culprit: (4, 2, "")}
    named = describe_positions(_positions(layout, where), layout, last_phase=2)
    assert named.startswith(f"culprit: replica {culprit} ("), named
    assert describe_positions(_positions(layout, where), layout).startswith(f"culprit: replica {1 - culprit} (")


def test_three_positions_without_majority_name_nobody():
    layout = ParallelLayout(3, 1)
    where = {0: (4, 1, AGREE), 1: (4, 1, FORWARD), 2: (4, 2, AGREE)}
    assert describe_positions(_positions(layout, where), layout).startswith("no replica stands out (")


def test_an_unreachable_store_names_replica_0_whose_rank_0_holds_it():
    from runner_fsm.agree.heartbeat import Heartbeat

    class GoneStore:
        def set_timeout(self, _):
            raise ConnectionResetError("Connection reset by peer")

    sentence = Heartbeat(GoneStore(), ParallelLayout(3, 2), 4).describe()
    assert sentence.startswith("culprit: replica 0 (the job's store, held by rank 0, is unreachable")
    assert "Connection reset by peer" in sentence
