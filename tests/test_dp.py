"""The DP agreement rule, without processes: `agree` over hand-made columns."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_fsm import dp
from runner_fsm.dp import (
    DRAFT_DECODE,
    DRAFT_PREFILL,
    GRAPH_EAGER,
    GRAPH_FULL,
    ROWS,
    STATUS_BATCH_ERROR,
    STATUS_FAULT,
    STATUS_SHUTDOWN,
    TARGET,
    DPSyncState,
    LocalDispatch,
    agree,
)
from runner_fsm.errors import DesyncError, ReplicaFault

CAPTURE = (1, 2, 4, 8, 16)


def cols(*num_tokens, step=7, phase=TARGET, graph=GRAPH_EAGER, uniform=0, reqs=1):
    return [
        LocalDispatch(step, phase, num_tokens=n, graph_mode=graph, uniform_token_count=uniform,
                      num_reqs=reqs)
        for n in num_tokens
    ]


def test_constants_and_row_order_are_the_contract():
    assert (TARGET, DRAFT_PREFILL, DRAFT_DECODE) == (1, 2, 3)
    assert (GRAPH_EAGER, GRAPH_FULL) == (0, 2)
    assert ROWS == ("step_id", "phase", "status", "num_tokens", "graph_mode",
                    "uniform_token_count", "num_reqs")
    assert tuple(f.name for f in dataclasses.fields(LocalDispatch)) == ROWS


def test_column_round_trip_follows_row_order():
    local = LocalDispatch(9, DRAFT_DECODE, 0, 12, GRAPH_FULL, 3, 4)
    assert local.to_column() == (9, 3, 0, 12, 2, 3, 4)
    assert LocalDispatch.from_column(local.to_column()) == local
    with pytest.raises(ValueError, match="7 rows"):
        LocalDispatch.from_column((1, 2, 3))


def test_pack_fills_only_own_column_and_sum_unpacks_to_columns():
    columns = cols(5, 0, 3)
    packed = [dp.pack(c, rank, 3) for rank, c in enumerate(columns)]
    assert packed[1].dtype == torch.int64 and tuple(packed[1].shape) == (7, 3)
    assert packed[1][:, 0].tolist() == [0] * 7 and packed[1][:, 2].tolist() == [0] * 7
    assert dp.unpack(sum(packed)) == columns


def test_identical_columns_agree_on_that_state():
    state = agree(cols(4, 4, step=3, graph=GRAPH_FULL, uniform=1, reqs=4), capture_sizes=CAPTURE)
    assert state == DPSyncState(3, TARGET, (4, 4), GRAPH_FULL, 1, 4, False)
    assert state.max_num_tokens == 4 and state.dp_size == 2 and state.use_graph


def test_phase_desync_names_each_replica_and_the_odd_one():
    columns = cols(4, 4, 4, step=5)
    columns[2] = dataclasses.replace(columns[2], phase=DRAFT_PREFILL)
    with pytest.raises(DesyncError) as caught:
        agree(columns)
    message = str(caught.value)
    assert "replica 0 sent step 5 TARGET" in message
    assert "replica 2 sent step 5 DRAFT_PREFILL" in message
    assert "expected step 5 TARGET" in message and "odd one(s) out: replica(s) 2" in message
    assert caught.value.sent == {0: (5, TARGET), 1: (5, TARGET), 2: (5, DRAFT_PREFILL)}


def test_step_desync_names_the_replica_that_skipped_a_collective():
    columns = cols(1, 1, 1, step=20)
    columns[0] = dataclasses.replace(columns[0], step_id=19)
    expected = r"expected step 20 TARGET, odd one\(s\) out: replica\(s\) 0 "
    with pytest.raises(DesyncError, match=expected) as caught:
        agree(columns)
    assert caught.value.sent[0] == (19, TARGET)


def test_abort_names_the_sender_its_step_and_reason():
    columns = cols(3, 3, 3, step=11)
    columns[1] = dataclasses.replace(columns[1], status=STATUS_FAULT, num_tokens=0)
    expected = r"^replica 1 aborted step 11 with status 2 \(fault\)"
    with pytest.raises(ReplicaFault, match=expected) as caught:
        agree(columns)
    assert (caught.value.replica, caught.value.status) == (1, STATUS_FAULT)


def test_several_aborts_report_the_lowest_replica_first_and_list_all():
    columns = cols(3, 3, 3)
    columns[2] = dataclasses.replace(columns[2], status=STATUS_SHUTDOWN)
    columns[1] = dataclasses.replace(columns[1], status=STATUS_BATCH_ERROR)
    with pytest.raises(ReplicaFault) as caught:
        agree(columns)
    assert (caught.value.replica, caught.value.status) == (1, STATUS_BATCH_ERROR)
    assert "status 1 (batch error)" in str(caught.value)
    assert "replica 2 sent status 3 (shutdown)" in str(caught.value)


def test_abort_outranks_the_desync_it_causes():
    columns = cols(3, 3)
    columns[1] = dataclasses.replace(columns[1], status=STATUS_FAULT, phase=DRAFT_DECODE)
    with pytest.raises(ReplicaFault):
        agree(columns)


def test_all_idle_means_no_forward_and_no_padding():
    state = agree(cols(0, 0, graph=GRAPH_FULL, uniform=1, reqs=0), capture_sizes=CAPTURE)
    assert state.all_idle and state.num_tokens_across_dp == (0, 0)
    assert state.graph_mode == GRAPH_EAGER


def test_graph_mode_is_the_minimum():
    columns = cols(2, 2, graph=GRAPH_FULL, uniform=1)
    columns[1] = dataclasses.replace(columns[1], graph_mode=GRAPH_EAGER)
    state = agree(columns, capture_sizes=CAPTURE)
    assert state.graph_mode == GRAPH_EAGER and state.num_tokens_across_dp == (2, 2)


def test_graph_mode_pads_every_replica_to_max_then_capture_size():
    state = agree(cols(5, 0, 3, graph=GRAPH_FULL, uniform=1), capture_sizes=CAPTURE)
    assert state.num_tokens_across_dp == (8, 8, 8) and state.graph_mode == GRAPH_FULL
    assert not state.all_idle


def test_graph_mode_keeps_an_exact_capture_size():
    state = agree(cols(4, 1, graph=GRAPH_FULL, uniform=1), capture_sizes=CAPTURE)
    assert state.num_tokens_across_dp == (4, 4)


def test_above_largest_capture_size_falls_back_to_eager_with_own_counts():
    state = agree(cols(17, 3, graph=GRAPH_FULL, uniform=1), capture_sizes=CAPTURE)
    assert state.graph_mode == GRAPH_EAGER and state.num_tokens_across_dp == (17, 3)


def test_no_capture_sizes_means_eager():
    state = agree(cols(2, 2, graph=GRAPH_FULL, uniform=1))
    assert state.graph_mode == GRAPH_EAGER and state.num_tokens_across_dp == (2, 2)


def test_eager_keeps_each_replica_count():
    state = agree(cols(9, 0, 3), capture_sizes=CAPTURE)
    assert state.num_tokens_across_dp == (9, 0, 3) and state.max_num_tokens == 9
    assert state.total_num_tokens == 12 and state.num_tokens_for(2) == 3


def test_uniform_count_ignores_zero_entries():
    columns = cols(4, 0, graph=GRAPH_FULL, uniform=2)
    columns[1] = dataclasses.replace(columns[1], uniform_token_count=0)
    state = agree(columns, capture_sizes=CAPTURE)
    assert state.uniform_token_count == 2 and state.graph_mode == GRAPH_FULL


def test_uniform_disagreement_is_zero_and_forces_eager():
    columns = cols(4, 6, graph=GRAPH_FULL, uniform=2)
    columns[1] = dataclasses.replace(columns[1], uniform_token_count=3)
    state = agree(columns, capture_sizes=CAPTURE)
    assert state.uniform_token_count == 0 and state.graph_mode == GRAPH_EAGER
    assert state.num_tokens_across_dp == (4, 6)


def test_num_reqs_is_the_maximum():
    columns = cols(1, 1, 1)
    columns[1] = dataclasses.replace(columns[1], num_reqs=6)
    assert agree(columns).num_reqs == 6


def test_empty_and_malformed_columns_are_rejected_clearly():
    with pytest.raises(ValueError, match="empty list"):
        agree([])
    with pytest.raises(ValueError, match=r"replica 1 sent num_tokens=-2 at step 7; expected >= 0"):
        agree(cols(1, -2))
    with pytest.raises(ValueError, match=r"replica 0 sent phase 9 at step 7"):
        agree(cols(1, phase=9))
    with pytest.raises(ValueError, match=r"replica 0 sent graph_mode 1 at step 7"):
        agree(cols(1, graph=1))


def _column(step, phase):
    return st.builds(
        LocalDispatch,
        step_id=st.just(step),
        phase=st.just(phase),
        status=st.sampled_from([0] * 9 + [STATUS_FAULT]),
        num_tokens=st.integers(0, 40),
        graph_mode=st.sampled_from([GRAPH_EAGER, GRAPH_FULL]),
        uniform_token_count=st.sampled_from([0, 1, 2, 4]),
        num_reqs=st.integers(0, 8),
    )


@st.composite
def _agreements(draw):
    dp_size = draw(st.integers(1, 4))
    step, phase = draw(st.integers(0, 3)), draw(st.sampled_from([TARGET, DRAFT_PREFILL]))
    columns = [draw(_column(step, phase)) for _ in range(dp_size)]
    # Sometimes one replica is a step or a phase off.
    if dp_size > 1 and draw(st.booleans()):
        odd = draw(st.integers(0, dp_size - 1))
        columns[odd] = dataclasses.replace(columns[odd], step_id=step + 1)
    sizes = tuple(sorted(draw(st.sets(st.integers(1, 32), max_size=5))))
    return columns, sizes


def _outcome(columns, sizes):
    try:
        return agree(columns, capture_sizes=sizes)
    except (DesyncError, ReplicaFault) as error:
        return type(error).__name__, str(error)


class _Group:
    """One replica's handle on a DP group whose all-reduce the replicas' threads run together."""

    def __init__(self, rank: int, ring: "_AllReduce"):
        self._rank, self.ring = rank, ring

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.ring.size


class _AllReduce:
    """gloo's SUM all-reduce among threads: each contributes its own tensor, each gets the sum
    written into that tensor in place, as `dist.all_reduce` does."""

    def __init__(self, size: int):
        self.size = size
        self.tensors: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(size)

    def __call__(self, tensor, op=None, group=None):
        self.tensors[group.rank()] = tensor
        self.barrier.wait()
        total = sum(t.clone() for t in self.tensors.values())
        self.barrier.wait()
        tensor.copy_(total)


def _sync_on_every_replica(columns, sizes, monkeypatch) -> list:
    """Each replica runs `dp.sync` itself (its own pack, its own view of the wire, its own
    decode of what came back), the all-reduce between them, in one thread per replica."""
    ring = _AllReduce(len(columns))
    monkeypatch.setattr(dp.dist, "all_reduce", ring)
    monkeypatch.setattr(dp.dist, "get_backend", lambda group: "gloo")
    outcomes: list = [None] * len(columns)

    def replica(rank: int) -> None:
        try:
            outcomes[rank] = dp.sync(_Group(rank, ring), columns[rank], capture_sizes=sizes)
        except (DesyncError, ReplicaFault) as error:
            outcomes[rank] = type(error).__name__, str(error)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(len(columns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


@settings(max_examples=300, deadline=None)
@given(_agreements())
def test_every_replica_reaches_the_same_outcome_from_the_all_reduce(case):
    """Every replica runs `dp.sync` over the shared all-reduce and must come out with the state
    (or the error) `agree` gives on the columns. Mutation seen to fail this: `dp.sync` packing
    its column at index 0 (`pack(local, 0, group.size())`) instead of at its own rank."""
    columns, sizes = case
    with pytest.MonkeyPatch.context() as monkeypatch:
        outcomes = _sync_on_every_replica(columns, sizes, monkeypatch)
    assert all(outcome == outcomes[0] for outcome in outcomes)
    assert outcomes[0] == _outcome(columns, sizes)
    state = outcomes[0]
    if isinstance(state, DPSyncState):
        own = [column.num_tokens for column in columns]
        assert all(agreed >= mine for agreed, mine in zip(state.num_tokens_across_dp, own))
        assert state.all_idle == (max(own) == 0)
        if state.graph_mode == GRAPH_FULL:
            assert state.max_num_tokens in sizes and len(set(state.num_tokens_across_dp)) == 1
        else:
            assert list(state.num_tokens_across_dp) == own


def test_wire_shape_differs_by_phase_over_the_same_bytes():
    shapes = {phase: dp.wire_shape(phase, 3) for phase in dp.PHASE_NAMES}
    assert len(set(shapes.values())) == len(dp.PHASE_NAMES)  # the Flight Recorder tells phases apart
    assert {int(np.prod(shape)) for shape in shapes.values()} == {dp.NUM_ROWS * 3}
    assert shapes[dp.TARGET] == (dp.NUM_ROWS, 3)
