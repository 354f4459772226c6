"""What lies before a seek, counted only when a finding needs it (`seek.SeekOrigin`): a window
found by bisection cites the lines and times a read from the start would.

Synthetic runs (`runner_fsm.testing.synth`), one file per rank and no step index: every window
below is found by bisection, which knows no line number.
"""

from __future__ import annotations

import pytest

from runner_fsm.audit import seek
from runner_fsm.replay.ranges import judge_range
from runner_fsm.replay.discover import discover
from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

DEFECTS = [Defect("illegal_transition", 1, 450), Defect("fault", 2, 470)]


@pytest.fixture(scope="module", params=[False, True], ids=["full", "compact"])
def run(request, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("origin"), SynthSpec(dp_size=3, pcp_size=2, steps=600,
                                                                  compact=request.param), DEFECTS)


def cited(verdicts, first: int) -> list[tuple]:
    return sorted((v.kind, v.step, v.file, v.line) for v in verdicts if v.step >= first and v.kind != "unfinished")


def test_a_window_found_by_bisection_cites_the_lines_of_a_whole_replay(run):
    """Each rank's findings (before `replay` merges those of several files into one, without a
    line) at the lines a read from the start numbers. Mutation seen to fail this:
    `SeekOrigin.line_shift` returning 0 (lines numbered from the seek) -> lines a few dozen in."""
    infos = discover(run)
    whole = cited(judge_range(infos).verdicts, 440)
    assert ("illegal_transition", 450) in [c[:2] for c in whole] and all(c[3] > 1000 for c in whole)
    assert cited(judge_range(infos, 440, None).verdicts, 440) == whole


def test_times_read_after_a_seek_are_those_of_a_read_from_the_start(run):
    """A compact log's times run on from step to step: after a seek, the fault's time and each
    log's end are on the segment's time base all the same. Mutation seen to fail this (compact):
    `SeekOrigin.time_shift` returning 0, the old behaviour -> every time after a seek early by
    the steps skipped."""
    infos = discover(run)
    whole, window = judge_range(infos), judge_range(infos, 440, None)
    assert [(f.rank, f.step, f.t_ns) for f in window.facts.faults] == \
        [(f.rank, f.step, f.t_ns) for f in whole.facts.faults if f.step >= 440] != []
    assert {r: e.t_ns for r, e in window.facts.ends.items()} == {r: e.t_ns for r, e in whole.facts.ends.items()}
    assert all(end.origin is not None for end in window.facts.ends.values())  # read from a seek indeed


def test_nothing_before_a_seek_is_read_while_the_window_is_sound(run, monkeypatch):
    """The point of seeking: a sound window never counts what lies before it. Mutation seen to
    fail this: `locate` counting the lines before the offset again (as it did, for every rank)."""
    counted = []
    original = seek.SeekOrigin._count
    monkeypatch.setattr(seek.SeekOrigin, "_count", lambda self: counted.append(self.path) or original(self))
    report = replay(run, steps=(100, 300))
    assert report.verdicts == () and counted == []
