"""`runner-fsm replay --last N` and `--steps A:B`: a window of steps judged alone, found without
reading the logs from the start, and a report that says what lies outside it.

Synthetic runs (`runner_fsm.testing.synth`), DP=3 x PCP=2, in full and compact alike.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from runner_fsm.replay import progress as progress_module
from runner_fsm.replay.progress import TerminalProgress
from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

DEFECTS = [Defect("agreed_mismatch", 0, 100), Defect("collective_mismatch", 2, 300)]


@pytest.fixture(scope="module", params=[False, True], ids=["full", "compact"])
def run(request, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("window"), SynthSpec(dp_size=3, pcp_size=2, steps=600,
                                                                  compact=request.param), DEFECTS)


def found(report) -> list[tuple]:
    return [(v.kind, v.replica, v.step) for v in report.verdicts]


def test_a_window_judges_its_steps_alone_and_says_what_lies_outside(run):
    """Mutation: `judge_range` keeping the warm-up steps' findings -> step 100's verdict at 250."""
    whole = found(replay(run))
    assert ("agreed_mismatch", 0, 100) in whole and ("collective_mismatch", 2, 300) in whole
    report = replay(run, steps=(104, 350))  # its warm-up (the steps read before it) holds step 100
    assert found(report) == [f for f in whole if 104 <= f[2] <= 350]
    assert (report.summary.window, report.summary.first_step, report.summary.last_step) == ((104, 350), 104, 350)
    assert "window: steps 104..350 judged; steps 0..103 and 351..599 of the logs not judged" in report.format()
    assert replay(run, steps=(99, 101)).summary.records < replay(run).summary.records / 50


def test_the_last_steps_of_a_run(run):
    """Mutation: `--last` ignoring the window (every step) -> step 100's and 300's verdicts."""
    report = replay(run, last=200)
    assert found(report) == [] and report.summary.window == (400, 599)
    text = report.format()
    assert "SOUND in steps 400..599: no findings in what was read (steps outside the window: not judged)" in text
    assert "SOUND: no findings" not in text


def test_a_window_judged_in_two_processes_finds_the_same(run):
    """Mutation: `judge_in_ranges` splitting the whole run instead of the window -> more records."""
    one, two = replay(run, steps=(200, 500), jobs=1), replay(run, steps=(200, 500), jobs=2)
    assert found(one) == found(two) == [("collective_mismatch", 2, 300)]
    assert one.summary.records == two.summary.records and two.summary.window == (200, 500)


def test_a_window_the_logs_do_not_reach_judges_nothing_and_says_so(run):
    report = replay(run, steps=(5000, 5100))
    assert report.summary.first_step is None and "NOTHING JUDGED" in report.format()


def test_a_hang_inside_the_window_is_named_and_its_end_is_not_unfinished_before_it(tmp_path):
    """Mutation: a log stopped at the window's end read as a log that ends there (`scan_rank`
    calling `finish()`) -> `unfinished` at the window's end."""
    run = write_run(tmp_path, SynthSpec(dp_size=3, pcp_size=2, steps=400), [Defect("hang", 1, 380)])
    assert found(replay(run, steps=(370, 399))) == found(replay(run))[-1:] == [("hang", 1, 380)]
    before = replay(run, steps=(300, 350))
    assert found(before) == [] and before.summary.notes == ()  # no stop: the logs go on


@pytest.mark.parametrize("argv, message", [(["--steps", "5:3"], "A <= B"), (["--steps", "x"], "A:B"),
                                           (["--last", "0"], "positive number of steps")])
def test_a_bad_window_is_a_usage_error(tmp_path, argv, message):
    run = write_run(tmp_path, SynthSpec(steps=4))
    out = subprocess.run([sys.executable, "-m", "runner_fsm.cli", "replay", *argv, str(run)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_shown_on_a_terminal_only(monkeypatch):
    """Mutation: `TerminalProgress` writing whatever stderr is -> text in a pipe."""
    monkeypatch.setattr(progress_module, "AFTER_S", 0.0)
    monkeypatch.setattr(progress_module, "EVERY_S", 0.0)
    shown, piped = _Terminal(), io.StringIO()
    for stream in (shown, piped):
        progress = TerminalProgress(stream)
        progress.span(0, 1000)
        progress(500)
        progress.close()
    assert "replay: step 500 of 0..1,000 (50%)" in shown.getvalue() and shown.getvalue().endswith("\r")
    assert piped.getvalue() == ""
