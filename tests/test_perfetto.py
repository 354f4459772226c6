"""`runner-fsm replay RUN_DIR --perfetto TRACE.json`: the trace's structure.

The trace of a real DP=2 x PCP=2 run with drafting (replica 1 idles while replica 0 works):
every event has ph, ts, pid, tid; one process per replica and one thread per rank; slices
nest on each thread; flow arrows pair up and land inside collective slices; the states and
collectives carry their args. A synthetic run with a hang gets the finding as an instant on
the culprit's threads, and the export holds memory flat as the log grows.
"""

import collections
import json
import tracemalloc

import pytest

from runner_fsm.replay.perfetto import export_perfetto
from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import Defect, SynthSpec, write_run
from runner_fsm.cli import main
from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request

EPS_US = 1e-3  # timestamps are microseconds with nanosecond decimals

WORKLOAD = [
    Request("long", tuple(range(5, 41)), 6, 0, replica=0),
    Request("mid", tuple(range(50, 62)), 4, 1, replica=0),
    Request("short", tuple(range(70, 75)), 2, 0, replica=1),
]


@pytest.fixture(scope="module")
def trace(models, tmp_path_factory):
    target, draft = models
    run_dir = tmp_path_factory.mktemp("run")
    cfg = EngineConfig(model_dir=target, draft_dir=draft, run_dir=str(run_dir), layout=ParallelLayout(2, 2),
                       num_speculative_tokens=2)
    assert run_engine(cfg, WORKLOAD, timeout_s=120).ok
    path = run_dir / "trace.json"
    assert main(["replay", str(run_dir), "--perfetto", str(path)]) == 0  # sound
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _slices(events):
    by_thread = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    return by_thread


@pytest.mark.multiproc
def test_every_event_is_placed(trace):
    assert trace
    for event in trace:
        assert {"ph", "ts", "pid", "tid"} <= event.keys(), event


@pytest.mark.multiproc
def test_one_process_per_replica_one_thread_per_rank(trace):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert names == {(0, 0): "rank 0 (dp 0, pcp 0)", (0, 1): "rank 1 (dp 0, pcp 1)", (1, 2): "rank 2 (dp 1, pcp 0)",
                     (1, 3): "rank 3 (dp 1, pcp 1)"}
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert processes == {0: "replica 0", 1: "replica 1"}
    assert {(e["pid"], e["tid"]) for e in trace if e["ph"] != "M"} == set(names)


@pytest.mark.multiproc
def test_slices_nest(trace):
    for thread, slices in _slices(trace).items():
        stack = []
        for s in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            end = s["ts"] + s["dur"]
            while stack and stack[-1] <= s["ts"] + EPS_US:
                stack.pop()
            assert not stack or end <= stack[-1] + EPS_US, (thread, s)
            stack.append(end)


@pytest.mark.multiproc
def test_states_and_collectives_carry_their_args(trace):
    states = collections.Counter(e["name"] for e in trace if e.get("cat") == "state")
    assert {"capturing", "prefill", "decode", "idle_dummy", "draft_sync"} <= set(states)
    dp = [e for e in trace if e.get("cat") == "collective" and e["args"]["group"] == "dp"]
    assert {e["args"]["phase"] for e in dp} == {"TARGET", "DRAFT_PREFILL", "DRAFT_DECODE"}
    for e in dp:
        args = e["args"]
        assert args["completed"] and args["sent"]["step_id"] == args["step"] == args["agreed"]["step_id"]
    forwards = [e for e in trace if e["name"] == "expert forward TARGET"]
    # a forward's rows: its shapes (and its batch's identity), the record does not repeat them
    assert forwards and all(e["args"]["shapes"] == [[e["args"]["batch"]["rows"]]] for e in forwards)
    # the idle replica's steps are idle_dummy slices on both of its ranks
    idle = collections.Counter(e["tid"] for e in trace if e["name"] == "idle_dummy")
    assert idle[2] == idle[3] > 0


@pytest.mark.multiproc
def test_flows_pair_up_inside_collectives(trace):
    ends = collections.defaultdict(list)
    for e in trace:
        if e["ph"] in "sf":
            ends[e["id"]].append(e)
    assert ends
    collectives = collections.defaultdict(list)
    for e in trace:
        if e.get("cat") == "collective":
            collectives[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for flow, pair in ends.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], flow
        start, finish = sorted(pair, key=lambda e: e["ph"], reverse=True)
        assert start["tid"] != finish["tid"] and finish["bp"] == "e"
        for end in pair:  # each end binds to a collective slice of its thread
            assert any(a - EPS_US <= end["ts"] <= b + EPS_US for a, b in collectives[end["tid"]]), end
    # every agreement joins both replicas of its DP group: one arrow per agreement and PCP rank
    agreements = sum(1 for e in trace if e.get("cat") == "collective" and e["args"]["group"] == "dp")
    assert len(ends) >= agreements // 2


def test_findings_are_instants_on_the_culprits_threads(tmp_path):
    write_run(tmp_path, SynthSpec(dp_size=2, pcp_size=2, steps=6), [Defect("hang", 1, 3)])
    report = replay(tmp_path)
    [hang] = [v for v in report.verdicts if v.kind == "hang"]
    export_perfetto(tmp_path, tmp_path / "t.json", report)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    found = [e for e in events if e["name"] == "finding: hang"]
    assert sorted(e["tid"] for e in found) == sorted(hang.ranks)
    assert all(e["ph"] == "i" and e["args"]["step"] == 3 and e["args"]["detail"] == hang.detail for e in found)


def test_export_memory_is_flat_in_log_size(tmp_path):
    peaks = []
    for steps in (300, 3000):
        run_dir = tmp_path / str(steps)
        write_run(run_dir, SynthSpec(dp_size=2, pcp_size=2, steps=steps))
        report = replay(run_dir)
        tracemalloc.start()
        export_perfetto(run_dir, run_dir / "t.json", report)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks  # 10x the log, not 10x the memory
