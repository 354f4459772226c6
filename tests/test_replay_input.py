"""Damaged and unreadable input: gaps and hangs, never a crash of the checker; exit code 2."""

import json
import os
import tracemalloc

import pytest

from runner_fsm.rules.checks import TransitionChecker
from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import SynthSpec, truncate_last_line, write_run
from runner_fsm.cli import main

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6)


def _run(tmp_path):
    return write_run(tmp_path / "run", SPEC)


def test_sound_run_exits_0_and_json_parses(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["replay", str(run)]) == 0
    assert "SOUND" in capsys.readouterr().out
    assert main(["replay", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["sound"] is True and data["verdicts"] == []
    assert data["summary"]["ranks"] == 4 and data["summary"]["counts"] == {}


def test_findings_exit_1_with_json_verdicts(tmp_path, capsys):
    run = _run(tmp_path)
    truncate_last_line(run / "rank-3.jsonl")
    assert main(["replay", str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    (verdict,) = data["verdicts"]
    assert verdict["kind"] == "gap" and verdict["replica"] == 1 and verdict["file"] == "rank-3.jsonl"
    assert data["summary"]["counts"] == {"gap": 1}
    assert main(["replay", str(run)]) == 1
    out = capsys.readouterr().out
    assert "first: gap" in out and "truncated last line" in out and "counts: gap 1" in out


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.97])
def test_sigkill_mid_line_is_a_gap_never_a_crash(tmp_path, keep):
    run = _run(tmp_path)
    truncate_last_line(run / "rank-0.jsonl", keep)
    report = replay(run)
    kinds = {v.kind for v in report.verdicts}
    assert kinds <= {"gap", "hang", "unfinished"}, report.format()
    if keep > 0:
        assert "gap" in kinds
    else:  # the whole last record (its shutdown) is gone: killed between steps, with no stop
        assert kinds == {"unfinished"} and not report.summary.notes, report.format()  # requested: a death


def test_sigkill_after_enqueue_is_a_hang(tmp_path):
    run = _run(tmp_path)
    path = run / "rank-1.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if b'"stage":"enqueue"' in line)
    path.write_bytes(b"".join(lines[: cut + 1]))
    (verdict,) = replay(run).verdicts
    assert verdict.kind == "hang" and verdict.step == SPEC.steps - 1
    assert "to blame: nobody" in verdict.detail  # its peer got past it: the log, not a peer, stopped
    assert "already past it: 0, 1" in verdict.detail  # the expert group spans every replica


def test_log_that_just_stops_is_unfinished(tmp_path):
    run = _run(tmp_path)
    path = run / "rank-2.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-3]))  # no shutdown, and its last step not finished
    (verdict,) = replay(run).verdicts
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("unfinished", 1, (2,))


def test_one_log_stopped_after_the_last_step_without_shutdown_or_stop_request_is_a_death(tmp_path):
    """Between steps after the run's last step, its peers shut down: with no stop request on
    record anywhere, the process died (e.g. OOM-killed while idle). Mutation: replay turning an
    `unfinished` between steps into a note when no `stop` record exists fails this."""
    run = _run(tmp_path)
    path = run / "rank-2.jsonl"
    path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:-1]))  # no shutdown
    report = replay(run)
    (verdict,) = report.verdicts
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("unfinished", 1, (2,)), report.format()
    assert not report.summary.notes


def test_garbage_and_empty_files_are_gaps_with_file_and_line(tmp_path):
    run = _run(tmp_path)
    path = run / "rank-1.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[4] = b'{"not json\n'
    path.write_bytes(b"".join(lines))
    (run / "rank-3.jsonl").write_bytes(b"")
    report = replay(run)
    gaps = [v for v in report.verdicts if v.kind == "gap"]
    assert [(v.file, v.line) for v in gaps] == [("rank-3.jsonl", 0), ("rank-1.jsonl", 5)], report.format()
    assert "unparsable line" in gaps[1].detail
    # the empty rank never reached the steps its peers agreed on
    assert any(v.kind == "missing_replica" and v.ranks == (3,) for v in report.verdicts)


@pytest.mark.parametrize("make", ["missing", "empty_dir", "a_file"])
def test_unreadable_input_exits_2(tmp_path, capsys, make):
    target = tmp_path / "target"
    if make == "empty_dir":
        target.mkdir()
    elif make == "a_file":
        target.write_text("x")
    assert main(["replay", str(target)]) == 2
    err = capsys.readouterr().err
    assert "ReplayInputError" in err and str(target) in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_exits_2(tmp_path):
    run = _run(tmp_path)
    (run / "rank-0.jsonl").chmod(0)
    assert main(["replay", str(run)]) == 2


def test_plot_without_matplotlib_exits_2_telling_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert main(["replay", str(_run(tmp_path)), "--plot", str(tmp_path / "t.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_writes_a_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from runner_fsm.testing.synth import Defect

    run = write_run(tmp_path / "run", SPEC, [Defect("fault", 1, 4)])
    assert main(["replay", str(run), "--plot", str(tmp_path / "t.png")]) == 1
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("record,problem", [
    (("decode", "ready", "decode", "ok"), None),
    (("decode", "ready", "prefill", "ok"), "the table leads to 'decode'"),
    (("draft", "ready", "ready", "refused"), None),
    (("draft", "ready", "draft_sync", "refused"), "must leave the state unchanged"),
    (("decode", "ready", "ready", "refused"), "refused although the table allows it"),
    (("decode", "ready", "ready", "error"), None),
    (("decode", "ready", "decode", "error"), None),
    (("decode", "ready", "idle_dummy", "error"), "a failed trigger leaves the replica in"),
    (("finish", "decode", "ready", "ok"), "does not chain onto the previous dst 'ready'"),
    (("decode", "ready", "decode", "maybe"), "unknown outcome"),
])
def test_transition_rules(record, problem):
    found = []
    checker = TransitionChecker(lambda kind, detail, line: found.append(detail))
    checker.state = "ready"
    checker.check(*record, line=1)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0], found


def test_memory_stays_flat_as_the_log_grows(tmp_path):
    def peak(steps):
        run = write_run(tmp_path / str(steps), SynthSpec(dp_size=2, pcp_size=1, steps=steps))
        replay(run, jobs=1)  # fills CPython's free lists, which would count as growth otherwise
        tracemalloc.start()
        try:
            assert replay(run, jobs=1).sound
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(60), peak(600)
    assert large < 1.3 * small + 100_000, (small, large)


def test_random_damage_is_judged_never_crashes(tmp_path):
    """Lines cut, dropped, swapped, or with a field of the wrong type: verdicts, no exception."""
    import random

    rng = random.Random(7)
    junk = [None, "x", -1, 1.5, [1, [2]], {"a": 1}, True]
    for trial in range(12):
        run = write_run(tmp_path / str(trial), SynthSpec(dp_size=2, pcp_size=2, steps=5))
        for path in sorted(run.glob("rank-*.jsonl")):
            lines = path.read_bytes().splitlines(keepends=True)
            for _ in range(3):
                i = rng.randrange(len(lines))
                damage = rng.choice(["cut", "drop", "swap", "retype"])
                if damage == "cut":
                    lines[i] = lines[i][: rng.randrange(len(lines[i]))] + b"\n"
                elif damage == "drop":
                    del lines[i]
                elif damage == "swap":
                    j = rng.randrange(len(lines))
                    lines[i], lines[j] = lines[j], lines[i]
                else:
                    record = json.loads(lines[i])
                    record[rng.choice(sorted(record))] = rng.choice(junk)
                    lines[i] = json.dumps(record).encode() + b"\n"
            path.write_bytes(b"".join(lines))
        for jobs in (1, 2):
            report = replay(run, jobs=jobs)
            assert report.exit_code == 1 and report.verdicts


def _drop(path, keep) -> None:
    """Rewrite a rank's log keeping the records `keep(record)` accepts (seq stays gapless)."""
    records = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    kept = [r for r in records if keep(r)]
    assert [r["seq"] for r in kept] == list(range(len(kept))), "only a tail may be dropped"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in kept))


def _not_shutdown(record) -> bool:
    return not (record["event"] == "transition" and record["trigger"] == "shutdown")


def test_every_rank_stopped_between_steps_without_a_stop_request_is_unfinished(tmp_path):
    """Every process killed between steps (SIGKILL, the machine's OOM killer), nothing on record
    asking for it: each rank is `unfinished`, never SOUND. Mutation: the old quiescent-stop
    note (every rank between steps after the last step reads sound) fails this."""
    run = _run(tmp_path)
    for rank in range(4):
        _drop(run / f"rank-{rank}.jsonl", _not_shutdown)
    report = replay(run)
    assert sorted(r for v in report.verdicts if v.kind == "unfinished" for r in v.ranks) == [0, 1, 2, 3]
    assert all("between steps" in v.detail for v in report.verdicts) and not report.summary.notes


@pytest.mark.parametrize("rank", [0, 3])
def test_one_rank_killed_mid_step_keeps_every_unfinished_verdict(tmp_path, rank):
    run = _run(tmp_path)
    for other in range(4):
        _drop(run / f"rank-{other}.jsonl", _not_shutdown)
    last = SPEC.steps - 1  # this rank dies inside its last step, right after entering it
    path = run / f"rank-{rank}.jsonl"
    records = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    entered = max(i for i, r in enumerate(records) if r["event"] == "transition" and r["step_id"] == last
                  and r["trigger"] in ("prefill", "decode", "idle"))
    _drop(path, lambda r: r["seq"] <= entered)
    report = replay(run)
    unfinished = {r: v for v in report.verdicts if v.kind == "unfinished" for r in v.ranks}
    assert set(unfinished) == {0, 1, 2, 3} and not report.summary.notes, report.format()
    assert f"at step {last} without shutdown, fault" in unfinished[rank].detail  # mid-step, in its step's state
    assert all("between steps" in v.detail for r, v in unfinished.items() if r != rank)


def test_ranks_stopped_after_different_steps_are_not_a_quiescent_stop(tmp_path):
    run = _run(tmp_path)
    for rank in range(4):
        _drop(run / f"rank-{rank}.jsonl", _not_shutdown)
    last = SPEC.steps - 1
    _drop(run / "rank-3.jsonl", lambda r: r["step_id"] != last)  # replica 1 stopped a step earlier
    report = replay(run)
    assert not report.sound and not report.summary.notes, report.format()
    assert (3,) in [v.ranks for v in report.verdicts if v.kind == "unfinished"]


def _shutdown_after_the_last_step(path) -> None:
    """Label a log's shutdown with the step number after its last step, as vLLM's worker does."""
    records = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    assert not _not_shutdown(records[-1])
    records[-1]["step_id"] += 1
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))


def test_a_rank_killed_a_step_before_a_peer_that_worked_on_is_unfinished(tmp_path):
    run = _run(tmp_path)
    last = SPEC.steps - 1
    _drop(run / "rank-3.jsonl", lambda r: r["step_id"] != last)  # killed after step last - 1
    _shutdown_after_the_last_step(run / "rank-0.jsonl")
    report = replay(run)
    assert not report.sound and not report.summary.notes, report.format()
    assert (3,) in [v.ranks for v in report.verdicts if v.kind == "unfinished"]
