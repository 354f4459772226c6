"""The DP agreement over real gloo groups: 2 replicas x 2 PCP ranks on 127.0.0.1.

Spawning costs about a second of CPU per process here, so one job runs every scenario in
sequence on the same process groups; children return outcomes as data and the parent asserts.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from runner_fsm import dp
from runner_fsm.config import ParallelLayout
from runner_fsm.dp import DRAFT_PREFILL, GRAPH_EAGER, GRAPH_FULL, TARGET, DPSyncState, LocalDispatch
from runner_fsm.engine.launch import SpawnError, SpawnTimeout, spawn
from runner_fsm.errors import DesyncError, ReplicaFault

pytestmark = pytest.mark.multiproc

LAYOUT = ParallelLayout(dp_size=2, pcp_size=2)
CAPTURE = (1, 2, 4, 8)
TOKENS = (5, 3)  # dispatch count N of replica 0 and 1; every PCP rank of a replica sends it


def _outcome(groups, local):
    """The agreed state, or the error every rank should see, as picklable data."""
    try:
        return dp.sync(groups.dp, local, capture_sizes=CAPTURE)
    except DesyncError as error:
        return ("DesyncError", str(error), error.sent)
    except ReplicaFault as error:
        return ("ReplicaFault", str(error), (error.replica, error.status))


def _scenarios(groups):
    replica = groups.dp_rank

    def local(step, phase=TARGET, **overrides):
        fields = dict(num_tokens=TOKENS[replica], graph_mode=GRAPH_FULL, uniform_token_count=1,
                      num_reqs=TOKENS[replica])
        fields.update(overrides)
        return LocalDispatch(step, phase, **fields)

    return {
        "ranks": (dist.get_rank(groups.dp), dist.get_rank(groups.pcp), groups.global_rank),
        "graph": _outcome(groups, local(10)),
        "eager_idle": _outcome(groups, local(11, graph_mode=GRAPH_EAGER,
                                             num_tokens=(4, 0)[replica])),
        "phase": _outcome(groups, local(12, phase=(TARGET, DRAFT_PREFILL)[replica])),
        "step": _outcome(groups, local((13, 14)[replica])),
        "abort": _outcome(groups, local(15, status=(0, dp.STATUS_BATCH_ERROR)[replica])),
        "after": _outcome(groups, local(16)),
    }


def test_sync_agrees_and_stops_every_rank_on_desync_or_abort():
    started = time.monotonic()
    results = spawn(_scenarios, LAYOUT, timeout_s=25)
    elapsed = time.monotonic() - started
    assert elapsed < 25

    # (global rank -> dp rank, pcp rank): the DP group's rank is the column index.
    assert [r["ranks"] for r in results] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    for name in ("graph", "eager_idle", "phase", "step", "abort", "after"):
        assert all(r[name] == results[0][name] for r in results), name

    first = results[0]
    assert first["graph"] == DPSyncState(10, TARGET, (8, 8), GRAPH_FULL, 1, 5, False)
    assert first["eager_idle"] == DPSyncState(11, TARGET, (4, 0), GRAPH_EAGER, 1, 5, False)

    kind, message, sent = first["phase"]
    assert kind == "DesyncError" and sent == {0: (12, TARGET), 1: (12, DRAFT_PREFILL)}
    assert "replica 1 sent step 12 DRAFT_PREFILL" in message and "replica(s) 1" in message

    kind, message, sent = first["step"]
    assert kind == "DesyncError" and sent == {0: (13, TARGET), 1: (14, TARGET)}
    assert "replica 0 sent step 13 TARGET, replica 1 sent step 14 TARGET" in message

    kind, message, (replica, status) = first["abort"]
    assert kind == "ReplicaFault" and (replica, status) == (1, dp.STATUS_BATCH_ERROR)
    assert message.startswith("replica 1 aborted step 15 with status 1 (batch error)")

    assert first["after"] == DPSyncState(16, TARGET, (8, 8), GRAPH_FULL, 1, 5, False)


def _raise_on_rank_one(groups):
    if groups.global_rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(60)  # the launcher must kill this rank rather than wait for it


def test_child_error_names_the_rank_and_kills_the_others():
    started = time.monotonic()
    with pytest.raises(SpawnError) as caught:
        spawn(_raise_on_rank_one, ParallelLayout(dp_size=2), timeout_s=25)
    assert time.monotonic() - started < 20
    assert caught.value.rank == 1 and caught.value.exc_type == "ValueError"
    assert str(caught.value).startswith("rank 1 raised ValueError: boom from rank 1")
    assert "_raise_on_rank_one" in caught.value.child_traceback


def _sleep(groups):
    time.sleep(60)


def test_deadline_kills_every_child_and_raises():
    started = time.monotonic()
    with pytest.raises(SpawnTimeout) as caught:
        spawn(_sleep, ParallelLayout(dp_size=1), timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert caught.value.pending_ranks == [0]
