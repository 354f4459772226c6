"""An `--inject` that never applied is said: the run exits 3 with one line per such fault naming
it and why (the replica was not idle at that step, the run ended first, ...); one that can never
apply in the run's shape is refused before the run starts."""

import json

import pytest

from runner_fsm.audit import read_records
from runner_fsm.replay.judge import replay
from runner_fsm.cli import main
from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request
from runner_fsm.errors import ConfigError
from runner_fsm.faults import Injection, Injector, why_not_fired

WORKLOAD = [  # replica 0 is busy from step 0 to past step 6; replica 1 idles from step 2 on
    Request("long", tuple(range(5, 41)), 14, 0, replica=0),
    Request("mid", tuple(range(50, 62)), 10, 1, replica=0),
    Request("short", tuple(range(70, 75)), 2, 0, replica=1),
]


def test_the_injector_remembers_what_it_applied():
    injector = Injector([Injection.parse("crash@replica=0,step=3"), Injection.parse("hang@replica=1,step=2")])
    assert not injector.due("crash", 0, 2) and not injector.due("crash", 1, 3)
    assert injector.not_fired(0) == (Injection("crash", 0, 3),)
    assert injector.due("crash", 0, 3)
    assert injector.not_fired(0) == () and injector.not_fired(1) == (Injection("hang", 1, 2),)


@pytest.mark.parametrize("text, seen, last, why", [
    ("skip-dummy-forward@replica=0,step=4", ("prefill", False), 20,
     "replica 0 was not idle at step 4 (it ran a prefill step; skip-dummy-forward applies to a dummy step)"),
    ("wrong-dispatch-count@replica=1,step=4", ("idle_dummy", False), 20,
     "replica 1 was idle at step 4 (wrong-dispatch-count applies to a step that runs a batch)"),
    ("skip-buffer-refresh@replica=1,step=9", ("idle_dummy", True), 20,
     "every replica was idle at step 9, so no forward ran"),
    ("stale-pcp-context@replica=1,step=1", ("idle_dummy", False), 20,
     "replica 1 had run no real batch before step 1, so it had no saved PCP context to reuse"),
    ("crash@replica=0,step=90", None, 23, "replica 0 never reached step 90: its run ended at step 23"),
])
def test_why_an_injection_never_fired(text, seen, last, why):
    assert why_not_fired(Injection.parse(text), seen, last) == why


@pytest.mark.parametrize("text, options, message", [
    ("hang@replica=2,step=4", {}, r"there is no replica 2 \(dp_size is 2\)"),
    ("wrong-dispatch-count@replica=0,step=0", {}, "needs pcp_size >= 2"),
    ("skip-draft-sync@replica=0,step=4", {}, "the run drafts nothing"),
    ("draft-count-mismatch@replica=0,step=4", {"num_speculative_tokens": 1}, "needs num_speculative_tokens >= 2"),
    ("pcp-divergence@replica=0,step=4", {}, "needs pcp_size >= 2"),
])
def test_an_injection_that_can_never_apply_is_refused_at_start(tmp_path, text, options, message):
    cfg = EngineConfig(model_dir="m", draft_dir="d", run_dir=str(tmp_path), layout=ParallelLayout(2, 1),
                       injections=(text,), **options)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


@pytest.mark.multiproc
def test_the_cli_says_which_injection_never_fired_and_exits_3(models, tmp_path, capsys):
    target, _ = models
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"id": r.req_id, "prompt_token_ids": list(r.prompt),
                                         "max_new_tokens": r.max_new_tokens, "arrival_step": r.arrival_step,
                                         "replica": r.replica}) + "\n" for r in WORKLOAD))
    code = main(["run", "--model", target, "--dp", "2", "--trace", str(trace), "--out", str(tmp_path / "out"),
                 "--inject", "skip-dummy-forward@replica=0,step=4", "--inject", "crash@replica=1,step=500"])
    err = capsys.readouterr().err
    assert code == 3, err
    lines = [line for line in err.splitlines() if "never fired" in line]
    assert lines == [
        "runner-fsm run: --inject skip-dummy-forward@replica=0,step=4 never fired: replica 0 was not idle at"
        " step 4 (it ran a decode step; skip-dummy-forward applies to a dummy step)",
        f"runner-fsm run: --inject crash@replica=1,step=500 never fired: replica 1 never reached step 500:"
        f" its run ended at step {lines and lines[1].rsplit(' ', 1)[-1]}"]
    assert (tmp_path / "out" / "outputs.jsonl").exists()  # the run itself went well
    # Replay says it from the logs alone: the job record names the injections, and no rank logged
    # either acting (mutation seen to fail this: `check_injections` returning no verdict).
    report = replay(tmp_path / "out")
    assert report.exit_code == 1
    found = [(v.kind, v.replica, v.step) for v in report.verdicts]
    assert found == [("injection_not_fired", 0, 4), ("injection_not_fired", 1, 500)], report.format()
    assert "replica 0 ran a decode step at step 4" in report.verdicts[0].detail
    assert "replica 1's log ends at step" in report.verdicts[1].detail and "before step 500" in report.verdicts[1].detail


@pytest.mark.multiproc
def test_a_fired_injection_is_not_reported(models, tmp_path):
    target, _ = models
    cfg = EngineConfig(model_dir=target, run_dir=str(tmp_path / "run"), layout=ParallelLayout(2, 2),
                       collective_timeout_s=3.0, injections=("wrong-dispatch-count@replica=0,step=0",))
    result = run_engine(cfg, WORKLOAD, timeout_s=120)
    assert not result.ok and result.not_fired == {}
    # the rank it acted on logged it (`injected`): replay finds the fault, not an injection unfired
    injected = [r for r in read_records(tmp_path / "run" / "rank-0.jsonl") if r["event"] == "injected"]
    assert [(r["injection"], r["step_id"]) for r in injected] == [("wrong-dispatch-count@replica=0,step=0", 0)]
    report = replay(tmp_path / "run")
    assert "injection_not_fired" not in report.counts() and "dispatch_mismatch" in report.counts(), report.format()
