"""A replica agrees with itself, through the embedded engine (fakes, real gloo processes).

Each fault makes one rank of a replica (its PCP rank K: the embedded engine's replicas have no
TP or PP) decide otherwise than its peers for one step, or an idle replica demote the graph
mode; replay must name kind, replica, step and rank from the evidence alone: the copies judged
here hold no `fault` or `injected` record (`stripped`). Each kind acts on the first rank of
replica 0 and on the last rank of the last replica, in one run per shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runner_fsm.audit import read_records
from runner_fsm.audit.decisions import DIGEST_FIELD
from runner_fsm.replay.judge import replay
from runner_fsm.config import GraphMode, ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request
from vllm_dp_cases import stripped

pytestmark = pytest.mark.multiproc

FAKES = "runner_fsm.testing.fakes:engine_model_and_drafter"
# kind -> (replica, step, rank within the replica): the first rank of replica 0, the last rank of
# replica 1 (PCP=3: a majority of two knows which rank is wrong)
RANK_FAULTS = [("tp-skip-draft", 0, 3, 0), ("tp-skip-draft", 1, 5, 2),
               ("rank-graph-mode", 0, 6, 0), ("rank-graph-mode", 1, 4, 2)]
DECISION = {"tp-skip-draft": "decided draft=0", "rank-graph-mode": "decided graph=0"}


def _run(run_dir: Path, layout: ParallelLayout, requests, injections, spec_tokens: int) -> Path:
    cfg = EngineConfig(model_dir=None, model_factory=FAKES, run_dir=str(run_dir), layout=layout,
                       num_speculative_tokens=spec_tokens, graph_mode=GraphMode.FULL_DECODE_ONLY,
                       collective_timeout_s=3.0, injections=tuple(injections))
    result = run_engine(cfg, requests, timeout_s=120)
    assert result.ok, result.errors
    return run_dir


@pytest.fixture(scope="module")
def rank_faults(tmp_path_factory) -> Path:
    requests = [Request(f"r{r}-{i}", tuple(range(5 + i, 17 + i)), 8, 0, replica=r) for r in range(2) for i in range(2)]
    injections = [f"{kind}@replica={r},step={s},rank={k}" for kind, r, s, k in RANK_FAULTS]
    return _run(tmp_path_factory.mktemp("rank-faults"), ParallelLayout(2, 3), requests, injections, spec_tokens=1)


def test_every_step_logs_its_decision_digest(rank_faults):
    """Every `finish` of every rank carries a digest. Mutation: `_record_transition` passing no
    decisions on `finish` -> fails."""
    for path in sorted(rank_faults.glob("rank-*.jsonl")):
        finishes = [r for r in read_records(path) if r.get("trigger") == "finish"]
        assert len(finishes) >= 8 and all(DIGEST_FIELD in r for r in finishes), path.name


def test_a_rank_that_decides_otherwise_is_named_from_the_evidence(rank_faults):
    """tp-skip-draft and rank-graph-mode, each on the first rank of replica 0 and the last rank
    of replica 1: `replica_divergence` names replica, step, rank and decision with the fault and
    injected records stripped, and nothing else diverges. Mutation: the scanner ignoring
    `decisions` (digests only) -> the decision is not named."""
    report = replay(stripped(rank_faults))
    found = [v for v in report.verdicts if v.kind == "replica_divergence"]
    by_step = sorted(RANK_FAULTS, key=lambda fault: fault[2])
    assert [(v.replica, v.step, v.ranks) for v in found] == [(r, s, (r * 3 + k,)) for _, r, s, k in by_step], \
        report.format()
    for verdict, (kind, *_) in zip(found, by_step):
        assert DECISION[kind] in verdict.detail, verdict
    # A skipped drafter also skipped the draft forward its peers logged: that collective, too.
    others = {(v.kind, v.replica, v.step) for v in report.verdicts if v.kind != "replica_divergence"}
    assert others <= {("collective_mismatch", r, s) for kind, r, s, _ in RANK_FAULTS if kind == "tp-skip-draft"} | {
        ("injection_not_fired", r, s) for _, r, s, _ in RANK_FAULTS}, report.format()


def test_an_idle_replica_that_demotes_the_graph_mode_is_named(tmp_path):
    """demote-graph-mode on replica 0 and on the last replica (each idle while replica 1
    decodes): `graph_mode_demoted` naming it at its step, from the stripped logs. Mutation:
    `_run_dummy` ignoring the fault (the idle replica proposes a graph) -> no verdict."""
    requests = [Request("busy", tuple(range(5, 17)), 10, 0, replica=1)] + [
        Request(f"short-{r}", tuple(range(20, 25)), 2, 0, replica=r) for r in (0, 2)]
    run = _run(tmp_path / "run", ParallelLayout(3, 1), requests,
               ["demote-graph-mode@replica=0,step=4", "demote-graph-mode@replica=2,step=6"], spec_tokens=0)
    report = replay(stripped(run))
    found = [(v.kind, v.replica, v.step) for v in report.verdicts if v.kind != "injection_not_fired"]
    assert found == [("graph_mode_demoted", 0, 4), ("graph_mode_demoted", 2, 6)], report.format()
    assert replay(run).exit_code == 1


@pytest.mark.parametrize("kind,rank", [("tp-skip-draft", 0), ("rank-graph-mode", 2),
                                       pytest.param("tp-skip-draft", 2, marks=pytest.mark.slow),
                                       pytest.param("rank-graph-mode", 0, marks=pytest.mark.slow)])
def test_online_consensus_stops_the_replica_naming_the_rank(tmp_path, kind, rank):
    """With `consensus` on, every rank of the replica stops at the fault's step with a
    DesyncError naming the PCP rank and the decision (a majority of three knows which rank), and
    replay of the stripped logs names the same. The default suite runs each kind on one end, the
    slow tier on the other. Mutation: `disagreement` comparing step ids only -> the run ends
    cleanly."""
    requests = [Request(f"r{i}", tuple(range(5 + i, 17 + i)), 8, 0) for i in range(2)]
    cfg = EngineConfig(model_dir=None, model_factory=FAKES, run_dir=str(tmp_path / "run"), layout=ParallelLayout(1, 3),
                       num_speculative_tokens=1, graph_mode=GraphMode.FULL_DECODE_ONLY, collective_timeout_s=3.0,
                       injections=(f"{kind}@replica=0,step=4,rank={rank}",), consensus=True)
    result = run_engine(cfg, requests, timeout_s=120)
    errors = [r.error for r in result.ranks]
    want = f"PCP rank {rank} {DECISION[kind]}"
    assert all(e is not None and e["type"] == "DesyncError" and "step 4" in e["message"] and want in e["message"]
               for e in errors), errors
    report = replay(stripped(tmp_path / "run"))
    found = [(v.kind, v.replica, v.step, v.ranks) for v in report.verdicts if v.kind != "injection_not_fired"]
    assert found == [("replica_divergence", 0, 4, (rank,))], report.format()
