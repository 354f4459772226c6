"""The rules of the agreement rows carried in vLLM's DP all-reduce, and the fault syntax (no vLLM)."""

from __future__ import annotations

import pytest

from runner_fsm import dp
from runner_fsm.errors import ConfigError, DesyncError, ReplicaFault
from runner_fsm.integrations.vllm.common import inject
from runner_fsm.integrations.vllm.dp.agreement import check_columns


def rows(*columns):
    """AGREEMENT_ROWS from (step, phase, seq, kind, status) columns, one per replica."""
    return [list(row) for row in zip(*columns)]


def test_in_step_agrees_with_vllms_counts():
    agreed = check_columns(rows((4, 1, 9, 0, 0), (4, 1, 9, 1, 0)), [64, 1], [0, 0])
    assert agreed == dp.DPSyncState(4, dp.TARGET, (64, 1), dp.GRAPH_EAGER, 0, 0, False)


@pytest.mark.parametrize("columns, culprit, step", [
    (((4, 1, 9, 0, 0), (5, 1, 9, 1, 0)), 1, 4),  # replica 1 reports the next step id
    (((5, 1, 9, 1, 0), (4, 1, 9, 0, 0)), 0, 4),  # the same on replica 0: no tie-break by rank
    (((4, 2, 9, 0, 0), (5, 1, 9, 1, 0)), 1, 4),  # replica 1 skipped the draft sync of step 4
    (((4, 3, 9, 0, 0), (4, 3, 10, 0, 0), (4, 3, 9, 0, 0)), 1, 4),  # one extra agreement: the odd seq
])
def test_desync_names_culprit_and_step(columns, culprit, step):
    with pytest.raises(DesyncError, match=rf"^culprit: replica {culprit} at step {step} ") as err:
        check_columns(rows(*columns), [1] * len(columns), [0] * len(columns))
    assert (err.value.culprits, err.value.culprit_step) == ((culprit,), step)


@pytest.mark.parametrize("culprit", [0, 1])
def test_an_extra_draft_agreement_names_its_sender_from_k(culprit):
    """K = 1 (the last phase DRAFT_PREFILL): the replica that entered a DRAFT_DECODE agreement
    ran a draft step its peers do not (draft-steps-mismatch), though its peer is ahead.
    Mutation: `check_columns` ignores `last_phase` -> the peer is named."""
    columns = [None, None]
    columns[culprit], columns[1 - culprit] = (5, dp.DRAFT_DECODE, 11, 1, 0), (6, dp.TARGET, 11, 0, 0)
    with pytest.raises(DesyncError, match=rf"^culprit: replica {culprit} at step 5 \(it sent step 5 DRAFT_DECODE"):
        check_columns(rows(*columns), [2, 2], [0, 0], last_phase=dp.DRAFT_PREFILL)


def test_abort_status_stops_every_replica_naming_sender():
    with pytest.raises(ReplicaFault, match="replica 1 aborted step 4") as err:
        check_columns(rows((4, 1, 9, 0, 0), (4, 1, 9, 1, dp.STATUS_FAULT)), [1, 1], [0, 0])
    assert err.value.replica == 1


def test_inject_syntax():
    assert inject.parse("skip-draft-sync@replica=1,step=5").kind == "skip-draft-sync"
    assert inject.parse("draft-steps-mismatch@replica=0,step=2").kind == "draft-steps-mismatch"
    assert (inject.parse(" desync@replica=0,step=12 ").replica, inject.parse("desync@replica=0,step=12").step) == (0, 12)
    for bad in ("crash@replica=1,step=5", "desync@replica=1", "desync"):
        with pytest.raises(ConfigError):
            inject.parse(bad)
    injector = inject.VLLMInjector(inject.parse("desync@replica=1,step=5"), dp_rank=1)
    assert injector.due("desync", 5) and not injector.due("desync", 4)
    assert not inject.VLLMInjector(inject.parse("desync@replica=1,step=5"), dp_rank=0).due("desync", 5)


def test_scheduled_drafts_must_be_prefixes_of_the_latest_proposals():
    from runner_fsm.integrations.vllm.dp.drafts import DraftLedger, DraftMismatchError

    ledger = DraftLedger(dp_rank=0)
    ledger.proposed(3, ["a", "b"], [[7, 8], [9, 10]])
    ledger.check_scheduled(4, {"a": [7, 8], "b": [9], "c": [-1, -1]})  # shortened; placeholders
    assert ledger.checked == 2
    with pytest.raises(DraftMismatchError, match=r"replica 0 step 5: .*'a': \[8\] scheduled, \[7, 8\] proposed at step 3"):
        ledger.check_scheduled(5, {"a": [8]})
    ledger.forget(["b"])
    with pytest.raises(DraftMismatchError, match="'b': \\[9\\] scheduled, nothing proposed"):
        ledger.check_scheduled(5, {"b": [9]})


@pytest.mark.parametrize("replica", [0, 1])
def test_an_injection_that_never_fired_says_why_on_its_replica(replica):
    from runner_fsm.integrations.vllm.common.inject import VLLMInjector, parse

    injection = parse(f"skip-dummy-forward@replica={replica},step=4")
    target, other = VLLMInjector(injection, replica), VLLMInjector(injection, 1 - replica)
    for step, kind in enumerate(["prefill", "decode", "decode", "decode", "decode", "idle"]):
        target.saw(step, kind)
        other.saw(step, kind)
    assert target.never_fired(5) == (f"inject skip-dummy-forward@replica={replica},step=4 never fired: replica"
                                     f" {replica} was not idle at step 4 (it ran a decode step);"
                                     " skip-dummy-forward acts on a dummy step")
    assert other.never_fired(5) is None  # only the replica it targets speaks
    early = VLLMInjector(parse(f"desync@replica={replica},step=9"), replica)
    assert early.never_fired(5) == (f"inject desync@replica={replica},step=9 never fired: the run ended"
                                    " after step 5, before step 9")


def test_an_injection_that_fired_is_silent():
    from runner_fsm.integrations.vllm.common.inject import VLLMInjector, parse

    injector = VLLMInjector(parse("desync@replica=0,step=2"), 0)
    injector.saw(2, "decode")
    assert not injector.due("desync", 1) and injector.never_fired(3) is not None
    assert injector.due("desync", 2) and injector.never_fired(3) is None


def test_graph_kinds_parse_and_go_to_the_graph_faults():
    """The graph-replay kinds parse (rank-graph-mode needs its rank), are owned by `GraphFaults`
    alone (neither the DP support's nor the replica check's injector holds them), and one that
    never met a replay says so. Mutation: `_dp_injection` keeping graph kinds -> fails."""
    from runner_fsm.integrations.vllm.dp.support import _dp_injection

    assert inject.parse("skip-input-refresh@replica=1,step=4").kind == "skip-input-refresh"
    assert inject.parse("rank-graph-mode@replica=0,step=3,rank=1").rank == 1
    assert inject.parse("demote-graph-mode@replica=2,step=8").replica == 2
    with pytest.raises(ConfigError, match="add ,rank=K"):
        inject.parse("rank-graph-mode@replica=0,step=3")
    assert _dp_injection("skip-input-refresh@replica=1,step=4") is None
    assert _dp_injection("rank-graph-mode@replica=0,step=3,rank=1") is None
    assert _dp_injection("demote-graph-mode@replica=1,step=8").kind == "demote-graph-mode"
    for replica in (0, 1):
        injector = inject.VLLMInjector(inject.parse(f"skip-input-refresh@replica={replica},step=4"), replica)
        injector.saw(4, "prefill")
        assert injector.never_fired(6) == (f"inject skip-input-refresh@replica={replica},step=4 never fired: replica"
                                           f" {replica} ran step 4 (prefill) without a graph replay, where"
                                           " skip-input-refresh acts")
    demote = inject.VLLMInjector(inject.parse("demote-graph-mode@replica=1,step=8"), 1)
    demote.saw(8, "decode")
    assert "was not idle at step 8" in demote.never_fired(9)


def test_graph_faults_refuse_a_runner_without_a_graph_manager():
    """V1 replays no graph from Python calls of its own: the fault is a start-up ConfigError,
    not a run that tests nothing. Mutation: `attach` without the check -> no error."""
    from types import SimpleNamespace

    from runner_fsm.integrations.vllm.graph_faults import GraphFaults
    from runner_fsm.integrations.vllm.runners.v1 import V1Runner

    faults = GraphFaults(inject.parse("skip-input-refresh@replica=0,step=4"), SimpleNamespace(), dp_rank=0, rank=0)
    with pytest.raises(ConfigError, match="skip-input-refresh acts where a graph manager replays"):
        faults.attach(V1Runner(object()))


def test_vllm_agreement_columns_are_proposals():
    """What a vLLM replica proposed to its target agreement, for `graph_mode_demoted`: vLLM's own
    column (num_tokens, cg_mode, ...) where no `graph_mode` is logged, an idle replica's dummy as
    no work. Evidence missing (no column): no mode, so no replica is judged a demoter."""
    from runner_fsm.replay.scan_collectives import _proposed

    assert _proposed({"kind": "dummy"}, {"num_tokens": 1, "vllm": [1, 0, 1, 1, 0, 1]}, 8) == (0, 0, 8)
    assert _proposed({}, {"num_tokens": 4, "vllm": [4, 2, 1, 1, 0, 4]}, 8) == (4, 2, 8)
    assert _proposed({}, {"num_tokens": 4, "graph_mode": 2}, 8) == (4, 2, 8)  # the embedded engine's
    assert _proposed({"kind": "dummy"}, {"num_tokens": 1}, 8) == (1, None, 8)
