"""A run killed with SIGKILL mid-way: every complete log line parses, and replay reports the
cut (a hang or a gap) instead of crashing."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner_fsm.audit.mapped import CHUNK, data_end
from runner_fsm.audit.replay import replay

pytestmark = pytest.mark.multiproc


def _lines(run_dir: Path) -> int:
    """Records of rank 0 so far (its log, still open, ends in blank lines: `audit.mapped`)."""
    path = run_dir / "rank-0.jsonl"
    return sum(1 for line in path.read_bytes().splitlines() if line.strip()) if path.exists() else 0


def test_sigkill_at_a_random_step_leaves_replayable_logs(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "runner_fsm.cli", "run", "--dp", "2", "--pcp", "2", "--requests", "24",
           "--max-new-tokens", "24", "--out", str(out)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = random.Random(os.getpid()).randint(60, 300)  # records of rank 0: a random step
    deadline = time.monotonic() + 120
    try:
        while _lines(out) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert _lines(out) >= target, "the run ended before the kill"

    for path in sorted(out.glob("rank-*.jsonl")):
        data = path.read_bytes()
        end = data_end(path)  # what was written; the rest of the last chunk is blank
        assert len(data) % CHUNK == 0 and len(data) > end, "the killed writer's file was cut"
        lines = data[:end].split(b"\n")
        # Every line is a record but the last, which a kill during its copy may have cut.
        for line in lines[:-2]:
            assert isinstance(json.loads(line), dict)
        assert len(lines[-2]) < 100_000 and lines[-1] == b""

    report = replay(out)  # must not raise: the cut is a finding, not a crash of the tool
    kinds = {v.kind for v in report.verdicts}
    # Unsound, unless every rank happened to be between steps after the same step: nothing
    # was half done then, and replay says so in a note (`settle_quiescent_stop`).
    quiescent = any("stopped between steps" in note for note in report.summary.notes)
    assert not report.sound or quiescent, "the cut went unreported"
    # Every process is killed at once: a rank caught between two steps, with no peer waiting
    # for it, is `unfinished` (its log stops with no shutdown); one caught in a collective is a
    # `hang`; one behind its peers is `missing_replica`; a cut line is a `gap`.
    assert kinds <= {"hang", "gap", "missing_replica", "unfinished"}, report.format()
    assert quiescent or kinds & {"hang", "missing_replica", "unfinished"}, report.format()

    cli = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "replay", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode in (0, 1), cli.stderr
    assert "Traceback" not in cli.stderr
