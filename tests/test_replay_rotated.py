"""Replaying a run whose logs were capped (`runner_fsm.audit.segments`): what is kept is judged,
what was rotated away is said, never judged, never a finding of its own.

The runs are synthetic (`SynthSpec(max_log_bytes=...)`: the synthetic records written through
`AuditLog` itself, under the cap), DP=3 x PCP=2 (a majority for every agreement), so ranks
rotate at slightly different steps. A finding is what the same run, uncapped, shows at the
steps that were kept.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.replay import discover as discover_module
from runner_fsm.replay.judge import replay
from runner_fsm.audit.segments import MIN_SEGMENT
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

CAPPED = SynthSpec(dp_size=3, pcp_size=2, steps=3000, max_log_bytes=8 * MIN_SEGMENT, pinned_steps=20)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The capped run without defects, written once for the tests that only read it (a write of
    3000 steps x 6 ranks through `AuditLog` is most of each test's time)."""
    return write_run(tmp_path_factory.mktemp("clean"), CAPPED)


def kinds(report) -> list[tuple]:
    return [(v.kind, v.replica, v.step) for v in report.verdicts]


def test_a_rotated_run_replays_sound_and_says_which_steps_it_did_not_see(clean_run):
    """Mutation: the merger ignoring rotated ranges (`StepMerger.blind` always False) ->
    missing_replica for the steps one rank rotated away before its peers."""
    report = replay(clean_run)
    assert report.sound, report.format()
    rotated = report.summary.rotated
    assert rotated and all(span.first == 0 and span.last > 1000 for span in rotated)
    assert {rank for span in rotated for rank in span.ranks} == set(range(6))
    assert report.summary.first_step == min(span.last for span in rotated) + 1
    text = report.format()
    assert "rotated away: steps 0.." in text and "SOUND in steps" in text and "\nSOUND: no findings" not in text
    data = report.as_dict()["summary"]
    assert data["rotated"] and set(data["rotated"][0]) == {"first", "last", "ranks"}


def uncapped(tmp_path, defects) -> list[tuple]:
    """The findings of the same run without a cap."""
    return kinds(replay(write_run(tmp_path / "uncapped", dataclasses.replace(CAPPED, max_log_bytes=None,
                                                                               compact=True), defects)))


@pytest.mark.parametrize("replica", [0, 2])
def test_a_finding_in_kept_steps_is_named_and_one_rotated_away_is_not(tmp_path, replica):
    """Mutation: judging a rotated log as if it were whole (no resume at the gap) -> a gap or
    an illegal transition where the kept segments begin."""
    defects = [Defect("agreed_mismatch", replica, 100), Defect("agreed_mismatch", replica, 2900)]
    run = write_run(tmp_path / "capped", CAPPED, defects)
    found = kinds(replay(run))
    assert found == [k for k in uncapped(tmp_path, defects) if k[2] == 2900]
    assert ("agreed_mismatch", replica, 2900) in found


def test_ranks_that_lost_different_steps_are_paired_on_the_steps_they_share(tmp_path, clean_run):
    """One rank lost more than its peers: the steps only its peers hold are judged among them
    (a finding there is named), never as that rank missing. Mutation: `_note_absent` counting
    a rank whose log no longer holds the step -> missing_replica."""
    common = replay(clean_run).summary.first_step
    defects = [Defect("agreed_mismatch", 0, common + 150)]
    run = write_run(tmp_path / "run", CAPPED, defects)
    segments = sorted((int(m[1]), name) for name in os.listdir(run) if (m := re.match(r"^rank-5\.(\d+)\.jsonl$", name)))
    for _, name in segments[:2]:  # the last rank rotated two more segments away
        os.unlink(run / name)
    report = replay(run)
    assert kinds(report) == uncapped(tmp_path, defects), report.format()
    assert ("agreed_mismatch", 0, common + 150) in kinds(report)
    lost = [span for span in report.summary.rotated if 5 in span.ranks]
    assert lost and lost[0].last > common + 150
    assert "every rank holds steps from" in report.format()


def test_a_fault_near_the_end_is_named_from_what_was_kept(tmp_path):
    """The pin itself is held by test_audit_segments. Mutation: `read_segments` leaving out the
    newest segment -> no fault named."""
    run = write_run(tmp_path, CAPPED, [Defect("fault", 1, 2990)])
    report = replay(run)
    faults = [v for v in report.verdicts if v.kind == "fault"]
    assert {(v.replica, v.step, v.error) for v in faults} >= {(1, 2990, "BatchError")}
    assert not [v for v in report.verdicts if v.kind in ("missing_rank", "missing_replica")]
    assert report.summary.rotated


def _live_job(run_dir, steps: int) -> list[AuditLog]:
    """Two ranks of a job that is still running (logs open), capped; rank 1 hangs in the last
    step's agreement that rank 0 never joins."""
    logs = [AuditLog(run_dir, "live", r, r, 0, shape=job_shape_fields(2, 1, r, 0), max_log_bytes=6 * MIN_SEGMENT,
                     pinned_steps=10) for r in range(2)]
    for log in logs:
        log.transition(-1, "capture", "init", "capturing", "ok")
        log.transition(-1, "captured", "capturing", "ready", "ok")
    agreed = {"phase": 1, "num_tokens_across_dp": [1, 1], "graph_mode": 0, "uniform_token_count": 0,
              "num_reqs": 1, "all_idle": False}
    for step in range(steps):
        for log in logs:
            log.transition(step, "decode", "ready", "decode", "ok")
            log.collective(step, "dp", "all_reduce", 1, [[7, 2]], step, "enqueue", sent={"num_tokens": 1})
            log.collective(step, "dp", "all_reduce", 1, [[7, 2]], step, "done", agreed={"step_id": step, **agreed})
            log.transition(step, "finish", "decode", "ready", "ok")
    logs[1].transition(steps, "decode", "ready", "decode", "ok")
    logs[1].collective(steps, "dp", "all_reduce", 1, [[7, 2]], steps, "enqueue", sent={"num_tokens": 1})
    return logs


def test_a_live_job_that_hangs_is_judged_while_its_logs_are_written(tmp_path):
    """Mutation: reading an open segment past its blank tail -> unparsable lines (gap)."""
    logs = _live_job(tmp_path, 3000)
    try:
        report = replay(tmp_path)
    finally:
        for log in logs:
            log.close()
    hangs = [v for v in report.verdicts if v.kind == "hang"]
    assert [(v.replica, v.step) for v in hangs] == [(0, 3000)], report.format()
    assert not [v for v in report.verdicts if v.kind in ("gap", "missing_replica", "missing_rank")]
    assert report.summary.rotated


def test_a_segment_rotated_away_while_replay_reads_is_skipped(tmp_path, monkeypatch):
    """The writer deletes a segment after replay found it: its steps count as rotated away.
    Mutation: `scan_rank` letting FileNotFoundError through -> exit 2 (unreadable)."""
    logs = _live_job(tmp_path, 3000)
    found = discover_module.discover

    def discover_then_rotate(run_dir):
        infos = found(run_dir)
        first = next(s for s in infos[0].segments if s.index > 0)
        os.unlink(first.path)  # as the live writer would, between discovery and reading
        return infos
    monkeypatch.setattr(discover_module, "discover", discover_then_rotate)
    try:
        report = replay(tmp_path)
    finally:
        for log in logs:
            log.close()
    assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("hang", 0, 3000)], report.format()
    assert any(0 in span.ranks for span in report.summary.rotated)


def test_the_cli_prints_the_rotated_range_and_judges_the_last_steps(clean_run):
    """Mutation: `resolve_window` counting the last N steps from the log's first step -> the
    wrong window."""
    out = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "replay", "--json", "--last", "100", str(clean_run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert summary["window"] == [2900, 2999] and summary["first_step"] == 2900 and summary["rotated"]
    assert out.stderr == ""  # no progress line: stderr is not a terminal


def test_an_embedded_run_under_a_small_cap(tmp_path):
    """The embedded engine (fakes, in process) with `max_log_bytes`: its logs rotate, the run
    replays sound and says which steps it no longer holds. Mutation: `EngineConfig.max_log_bytes`
    not passed to the rank's AuditLog -> one file, nothing rotated."""
    from runner_fsm.engine.api import run_engine
    from runner_fsm.engine.config import EngineConfig
    from runner_fsm.engine.requests import synthetic_requests

    cfg = EngineConfig(model_dir=None, model_factory="runner_fsm.testing.fakes:engine_model_and_drafter",
                       run_dir=str(tmp_path), max_log_bytes=6 * MIN_SEGMENT)
    result = run_engine(cfg, synthetic_requests(4, vocab_size=64, max_new_tokens=600, seed=1), in_process=True,
                        timeout_s=300)
    assert result.ok, [r.error for r in result.errors]
    assert len([name for name in os.listdir(tmp_path) if re.match(r"^rank-0\.\d+\.jsonl$", name)]) > 1
    report = replay(tmp_path)
    assert report.sound and report.summary.rotated, report.format()


@pytest.mark.parametrize("flag, value", [("64K", 64 << 10), ("2G", 2 << 30), ("0", None)])
def test_the_run_flag(flag, value):
    from runner_fsm.cli import build_parser

    assert build_parser().parse_args(["run", "--max-log-bytes", flag, "--out", "x"]).max_log_bytes == value


def test_a_bad_run_flag_is_a_usage_error(capsys):
    from runner_fsm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--max-log-bytes", "lots", "--out", "x"])
    assert exit_.value.code == 2 and "expected a byte count" in capsys.readouterr().err


def test_compressed_segments_replay_as_plain_ones(tmp_path):
    """Closed segments gzip-compressed (one member per step-index entry): the same verdicts and
    rotated steps as the same run kept plain, a window seeks into them, and `read_records`
    reads them. Mutations: a segment read as following segment 0 when that one was cut to its
    head (`ranklog.read_segments` going by numbers alone) -> a gap and missing_replica where it
    was cut; `open_lines` ignoring a seek's member offset -> the window's findings differ."""
    defects = [Defect("agreed_mismatch", 2, 2700)]
    runs = {}
    for compress in (False, True):
        runs[compress] = write_run(tmp_path / str(compress), dataclasses.replace(CAPPED, compress_segments=compress),
                                   defects)
    gz = sorted(name for name in os.listdir(runs[True]) if name.endswith(".jsonl.gz"))
    assert gz and not any(name.endswith(".jsonl") and name + ".gz" in gz for name in os.listdir(runs[True]))
    # Both runs fill the same cap, so their totals are alike: what compression buys is the text
    # each closed segment holds in fewer bytes (and so the more steps the cap keeps, below).
    packed_bytes = sum((runs[True] / name).stat().st_size for name in gz)
    assert packed_bytes * 3 < sum(len(gzip.decompress((runs[True] / name).read_bytes())) for name in gz)
    for window in (None, (2650, 2750)):
        kept, packed = (replay(runs[c], steps=window) for c in (False, True))
        assert kinds(packed) == kinds(kept) and ("agreed_mismatch", 2, 2700) in kinds(packed)
        if window is None:  # compressed, the same cap holds more of the run
            assert packed.summary.first_step < kept.summary.first_step
        else:
            assert packed.summary.records == kept.summary.records
    first = sorted(gz)[0]
    assert [r["event"] for r in read_records(runs[True] / first)][:2] == ["job", "collective"]
