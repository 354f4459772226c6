"""Admission control: a request that can never fit is refused at submission (no step runs),
and a scheduler that cannot progress stops with an error instead of idling for ever."""

import subprocess
import sys

import pytest

from runner_fsm.audit import read_records
from runner_fsm.replay.judge import replay
from runner_fsm.cli import main
from runner_fsm.engine import preflight, scheduler
from runner_fsm.engine.requests import Request
from runner_fsm.engine.scheduler import RequestRefused, Scheduler, SchedulerConfig, SchedulerStalled


def test_request_beyond_the_replicas_kv_blocks_is_refused():
    # 30 prompt + 10 new tokens need 39 positions: 10 blocks of 4; the replica has 8.
    cfg = SchedulerConfig(num_kv_blocks=8, block_size=4, max_blocks_per_req=64)
    with pytest.raises(RequestRefused, match=r"request 'big' .* 10 blocks of 4, but the replica has only 8 KV blocks"):
        Scheduler([Request("ok", (1, 2, 3), 2), Request("big", tuple(range(1, 31)), 10)], cfg)


def test_drafts_count_toward_the_kv_a_request_needs():
    # K = 2: the last decode verifies 1 + 2 rows and drafts 2 past them: 30 + 2 - 1 + 4 = 35 > 32.
    cfg = SchedulerConfig(num_kv_blocks=8, block_size=4, num_speculative_tokens=2)
    with pytest.raises(RequestRefused, match="needs up to 35 KV positions"):
        Scheduler([Request("r", tuple(range(1, 31)), 2)], cfg)
    Scheduler([Request("r", tuple(range(1, 31)), 2)], SchedulerConfig(num_kv_blocks=9, block_size=4,
                                                                      num_speculative_tokens=2))


def test_request_beyond_max_model_len_is_refused():
    with pytest.raises(RequestRefused, match=r"needs 25 positions \(20 prompt \+ 5 new tokens\), more than max_model_len=24"):
        Scheduler([Request("r", tuple(range(1, 21)), 5)], SchedulerConfig(max_model_len=24))


def test_a_scheduler_that_can_never_progress_stops_with_an_error():
    sched = Scheduler([Request("a", tuple(range(1, 10)), 3)], SchedulerConfig(num_kv_blocks=4, block_size=4))
    leaked = sched.allocator.allocate(2)  # blocks held by nobody the scheduler knows: never freed
    assert leaked == [0, 1]
    with pytest.raises(SchedulerStalled, match=r"step 0: request 'a' needs 3 KV blocks .* only 2 of 4 are free"
                                               r" with nothing running"):
        sched.schedule(0)


def test_cli_refuses_what_cannot_fit_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "run", "--kv-blocks", "2", "--requests", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("runner-fsm run: RequestRefused: replica 0: request 'r0' (42 prompt + 8 new tokens)")
    assert "but the replica has only 2 KV blocks (--kv-blocks)" in proc.stderr
    assert not (out / "outputs.jsonl").exists()
    assert not list(out.glob("rank-*.jsonl"))  # no step ran, no rank started


def test_a_stalled_run_exits_non_zero_and_its_log_ends_with_the_fault(tmp_path, monkeypatch, capsys):
    # Admission would refuse this run; switched off, the scheduler's own stop must end it.
    monkeypatch.setattr(preflight, "admission_error", lambda req, cfg: None)
    monkeypatch.setattr(scheduler, "admission_error", lambda req, cfg: None)
    out = tmp_path / "run"
    assert main(["run", "--kv-blocks", "2", "--requests", "3", "--out", str(out)]) == 1
    assert "SchedulerStalled: step 0: request 'r0' needs 3 KV blocks" in capsys.readouterr().out
    assert not (out / "outputs.jsonl").exists()
    records = list(read_records(out / "rank-0.jsonl"))
    assert [r["event"] for r in records[-2:]] == ["fault", "transition"]
    assert records[-2]["error"] == "SchedulerStalled"
    assert records[-1]["dst"] == "faulted"
    report = replay(str(out))
    assert [(v.kind, v.replica) for v in report.verdicts] == [("fault", 0)]
    assert "SchedulerStalled" in report.verdicts[0].detail
