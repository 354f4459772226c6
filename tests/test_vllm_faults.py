"""Injected DP faults through vLLM: every rank stops, naming the culprit replica and step, and
`runner-fsm replay --json` names the same replica and step.

Each kind runs Mixtral with draft_model drafting (K=2; not on MRV2, whose draft-model speculator
fails under DP in vLLM 0.32 itself) on two DP engines; replica 1 is idle from step ~2 on. The
skips hit the idle replica 1 at step S; the desync is sent by the busy replica 0 (so both
replicas are named by some case). `skip-dummy-forward` and `skip-draft-sync` leave replica 0
waiting in an expert exchange or a draft all-reduce that replica 1 never joins (vLLM would
hang): the watchdog ends both after `collective_timeout_s`. `desync` is caught in the very
all-reduce it corrupts: with two replicas no majority decides, the replica ahead in (step,
phase, sequence) order is named. The runs share the machine at once.
Every rank leaves its Flight Recorder dump (`fr-rank-<r>.json`, on by default), and replay
joins it: the verdict naming the culprit rests on both sources.
"""

from __future__ import annotations

import re
import threading

import pytest
import vllm_dp_cases as c
from conftest import EXPECTED_RUNNER

from runner_fsm.replay.flight import read_dumps
from runner_fsm.integrations.vllm.offline_dp import Job

pytestmark = pytest.mark.vllm

# kind -> the replica it is injected on (a skip needs the idle replica; a desync any replica)
CULPRIT = {"skip-dummy-forward": 1, "skip-draft-sync": 1, "desync": 0}
DRAFTING = EXPECTED_RUNNER == "v1"  # MRV2: no drafter under DP (see above), so no draft sync to skip
KINDS = tuple(k for k in CULPRIT if DRAFTING or k != "skip-draft-sync")
STEP = 5
NEVER_FIRES = "skip-dummy-forward@replica=0,step=4"  # replica 0 is busy at step 4: nothing to skip
TIMEOUT_S = 20.0
# After detection: the watchdog polls (0.25 s) and lingers for its peers (3 s); the worker
# process exits, vLLM's engine sees it die and shuts down, the interpreter exits. Seen: 10 s
# (desync) to 22 s after detection with a load average of ~20 on the 2 cores; hence 30 s.
BOUND_S = 30.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-faults")
    models = c.make_models(root / "models")
    out = {}

    def one(kind: str) -> None:
        run_dir = root / f"run-{kind}"
        inject = NEVER_FIRES if kind == "never" else f"{kind}@replica={CULPRIT[kind]},step={STEP}"
        options = {"inject": inject, "collective_timeout_s": TIMEOUT_S}
        job = Job(c.kwargs(models, "mixtral", drafting=DRAFTING, run_dir=str(run_dir), options=options), c.PER_RANK)
        out[kind] = (c.run([job], 2, root, timeout_s=900), run_dir)

    threads = [threading.Thread(target=one, args=(kind,)) for kind in KINDS + ("never",)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _injected_step_start_ns(run_dir) -> int:
    return min(r["t_ns"] for rank in range(2) for r in c.records(run_dir / f"rank-{rank}.jsonl")
               if r["step_id"] == STEP)


@pytest.mark.parametrize("kind", KINDS)
def test_fault_stops_every_rank_naming_culprit(runs, kind):
    result, run_dir = runs[kind]
    assert all(code not in (0, None) for code in result.codes), (result.codes, result.logs[0][-3000:])
    for log in result.logs:
        assert re.search(rf"culprit: replica {CULPRIT[kind]} at step {STEP}\b", log), log[-3000:]
    faults = [r for rank in range(2) for r in c.records(run_dir / f"rank-{rank}.jsonl") if r["event"] == "fault"]
    assert {r["dp_rank"] for r in faults} == {0, 1}
    began_ns = _injected_step_start_ns(run_dir)
    detected_s = (min(r["t_ns"] for r in faults) - began_ns) / 1e9
    ended_s = [at - began_ns / 1e9 for at in result.ended_at]
    expected = TIMEOUT_S if kind != "desync" else 0.0
    assert expected <= detected_s + 0.5 <= expected + BOUND_S, detected_s
    assert all(expected < s <= expected + BOUND_S for s in ended_s), ended_s
    print(f"\n{kind}: detected {detected_s:.2f} s after step {STEP} began; processes ended after"
          f" {', '.join(f'{s:.1f}' for s in ended_s)} s; codes {result.codes}")


@pytest.mark.parametrize("kind", KINDS)
def test_replay_names_same_replica_and_step(runs, kind):
    _, run_dir = runs[kind]
    code, verdicts = c.replay_json(run_dir)
    assert code == 1
    named = [(v["replica"], v["step"]) for v in verdicts if v["kind"] in ("hang", "collective_mismatch",
                                                                           "missing_replica", "agreed_mismatch")]
    print(f"\n{kind}: replay verdicts " + "; ".join(f"{v['kind']} replica {v['replica']} step {v['step']}"
                                                 for v in verdicts))
    assert named and named[0] == (CULPRIT[kind], STEP), verdicts


# What the dumps add to the verdict: where rank 0 waited in a collective rank 1 never issued
# (the expert exchange's all_gather, the draft agreement), or the corrupted agreement gloo matched.
FLIGHT_RECORDER_SAW = {
    "skip-dummy-forward": "flight recorder: group expert",
    "skip-draft-sync": "flight recorder: group dp",
    "desync": "matched by gloo as one collective, but the audit log says rank 0 as step 6 TARGET; rank 1 as step 5",
}


@pytest.mark.parametrize("kind", KINDS)
def test_flight_recorder_dumped_and_joined(runs, kind):
    _, run_dir = runs[kind]
    dumps = read_dumps(run_dir)
    assert sorted(dumps) == [0, 1]
    expected = "fault" if kind == "desync" else "timeout"
    assert {d.reason for d in dumps.values()} == {expected}
    for rank, dump in dumps.items():  # the DP agreement's group, named as the audit log names it
        pg = dump.pg_of("dp")
        assert dump.members[pg] == (0, 1) and dump.entries[pg], (rank, dump.names)
    _, verdicts = c.replay_json(run_dir)
    # the culprit's verdict that the dumps back (a skip is also named from the audit log alone, by
    # a collective_mismatch of its own; which comes first depends on what the logs hold)
    named = [v for v in verdicts if (v["replica"], v["step"]) == (CULPRIT[kind], STEP)
             and v["kind"] in ("hang", "collective_mismatch", "missing_replica", "agreed_mismatch")
             and "flight_recorder" in v["evidence"]]
    assert named, verdicts
    assert FLIGHT_RECORDER_SAW[kind] in named[0]["detail"], named[0]["detail"]
    if kind != "desync":
        assert "started and never completed by rank(s) 0; never started by rank(s) 1" in named[0]["detail"]
    assert not [v for v in verdicts if v["kind"] == "source_disagreement"], verdicts


def test_an_injection_that_never_fired_is_a_finding(runs):
    """The run ends normally, but it tested nothing: the replica the fault targets says why on
    stderr, and replay names it from the logs alone (`injection_not_fired`, exit 1): the job
    record names the injection, no rank logged it acting."""
    result, run_dir = runs["never"]
    assert result.codes == [0, 0], result.logs[0][-3000:]
    line = (f"inject {NEVER_FIRES} never fired: replica 0 was not idle at step 4 (it ran a decode step);"
            " skip-dummy-forward acts on a dummy step")
    assert f"FSMWorker: {line}" in result.logs[0] and line not in result.logs[1]
    code, verdicts = c.replay_json(run_dir)
    assert code == 1 and [(v["kind"], v["replica"], v["step"]) for v in verdicts] == \
        [("injection_not_fired", 0, 4)], verdicts
    assert "replica 0 ran a decode step at step 4" in verdicts[0]["detail"]
