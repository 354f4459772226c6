"""A stop you asked for reads clean, a death never does (`rules.stops`, DESIGN section 11).

Synthetic runs cut the way real stops and deaths cut them: logs that end between steps, in a
collective, or after faults, with `stop` records (a signal a rank received, the engine's
shutdown call) placed before or after where the other logs end. Faults on replica 0 and on
the last replica. Each test names the mutation of `rules.stops` it was seen to fail under.
"""

from __future__ import annotations

import json

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import SynthSpec, write_run

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6)
DP_ONLY = SynthSpec(dp_size=2, pcp_size=1, steps=6)
LAST = SPEC.steps - 1
LATE = 10**12  # a t_ns after every record of the synthetic logs (theirs count from 1e6 by 1e3)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _write(path, records) -> None:
    for seq, record in enumerate(records):
        record["seq"] = seq
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))


def _stop_record(like: dict, step, t_ns: int, signal="SIGINT") -> dict:
    header = {k: like[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}
    source = "signal" if signal else "shutdown"
    return {**header, "seq": 0, "t_ns": t_ns, "event": "stop", "step_id": step, "source": source,
            "signal": signal, "detail": ""}


def _kill(path, *, stop_at: int | None = None, keep=lambda r: True, signal="SIGINT") -> dict:
    """Cut a rank's log: no shutdown, only the records `keep` accepts; with `stop_at`, a `stop`
    record at that time (t_ns) first. Returns the last record kept."""
    records = [r for r in _records(path) if keep(r)
               and not (r["event"] == "transition" and r["trigger"] == "shutdown")]
    if stop_at is not None:
        records.append(_stop_record(records[-1], records[-1]["step_id"], stop_at, signal))
    _write(path, records)
    return records[-1]


def _inside_last_expert_exchange(path) -> list[dict]:
    """A rank's records up to its enqueue of the last step's expert exchange: it waits there."""
    records = _records(path)
    cut = next(i for i, r in enumerate(records) if r["step_id"] == LAST and r.get("group") == "expert"
               and r.get("stage") == "enqueue")
    return records[: cut + 1]


def _end_ns(path) -> int:
    return _records(path)[-1]["t_ns"]


@pytest.mark.parametrize("jobs", [1, 2])
def test_every_rank_stopped_on_its_own_signal_is_sound_with_a_note(tmp_path, jobs):
    """Ctrl-C to the job: each rank recorded SIGINT, then was killed between steps (vLLM's
    force-kill). Mutation: `settle_stops` returning the verdicts unchanged fails this."""
    run = write_run(tmp_path / "run", SPEC)
    for rank in range(4):
        _kill(run / f"rank-{rank}.jsonl", stop_at=LATE + rank)
    report = replay(run, jobs=jobs)
    assert report.sound, report.format()
    (note,) = [n for n in report.summary.notes if n.startswith("stop requested")]
    assert note.startswith(f"stop requested: SIGINT (rank 0, step {LAST}), the first of 4 stop request(s),"
                           " by rank(s) 0, 1, 2, 3; rank(s) 0, 1, 2, 3 ended after it"), note


@pytest.mark.parametrize("killed", [0, 3])
def test_killed_between_steps_with_no_stop_request_anywhere_is_a_death(tmp_path, killed):
    """The run's other ranks shut down normally; one died idle. Mutation: the quiescent-stop
    rule of before (any rank between steps after the last step is a note) fails this."""
    run = write_run(tmp_path / "run", SPEC)
    _kill(run / f"rank-{killed}.jsonl")
    report = replay(run)
    assert [(v.kind, v.ranks) for v in report.verdicts] == [("unfinished", (killed,))], report.format()
    assert not report.summary.notes


@pytest.mark.parametrize("killed", [0, 3])
def test_a_rank_alive_after_a_peers_request_ended_after_it(tmp_path, killed):
    """A rank killed before its handler could run (blocked in C++), whose log goes on after the
    stop request a peer recorded. Mutation: `explains_end` requiring the rank's own record fails this."""
    run = write_run(tmp_path / "run", SPEC)
    end = _kill(run / f"rank-{killed}.jsonl")
    for rank in set(range(4)) - {killed}:
        _kill(run / f"rank-{rank}.jsonl", stop_at=end["t_ns"] - 1)  # recorded before its last record
    report = replay(run)
    assert report.sound, report.format()
    assert "rank(s) 0, 1, 2, 3 ended after it" in report.summary.notes[-1]


@pytest.mark.parametrize("killed", [0, 3])
def test_a_rank_that_died_before_any_request_is_named(tmp_path, killed):
    """Done-when (d) in miniature: one process dies idle, then vLLM stops the others, which record
    it. Mutation: `request_before` ignoring time (any stop explains every end) fails this."""
    run = write_run(tmp_path / "run", SPEC)
    end = _kill(run / f"rank-{killed}.jsonl")
    for rank in set(range(4)) - {killed}:
        _kill(run / f"rank-{rank}.jsonl", stop_at=end["t_ns"] + 10**6, signal=None)  # the shutdown call
    report = replay(run)
    assert [(v.kind, v.replica, v.ranks) for v in report.verdicts] == [("unfinished", killed // 2, (killed,))]
    note = report.summary.notes[-1]
    assert "the engine's shutdown call" in note and f"rank(s) {killed} ended before any stop request" in note


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_rank_waiting_in_a_collective_its_peer_left_because_of_the_stop(tmp_path, stopped):
    """DP=2: one replica recorded the stop between steps and never came to the next agreement;
    the other waits in it, blocked in C++, and is killed without a record of its own. Its peer's
    record covers it; without that record the hang stays, blaming the peer. Mutation:
    `settle_stops` leaving `hang` out of END_KINDS fails this."""
    waiting = 1 - stopped
    for with_stop in (True, False):
        run = write_run(tmp_path / str(with_stop), DP_ONLY)
        end = _kill(run / f"rank-{stopped}.jsonl", keep=lambda r: r["step_id"] != LAST,
                    stop_at=LATE if with_stop else None)
        first_enqueue = next(i for i, r in enumerate(_records(run / f"rank-{waiting}.jsonl"))
                             if r["step_id"] == LAST and r.get("stage") == "enqueue")
        records = _records(run / f"rank-{waiting}.jsonl")[: first_enqueue + 1]
        _write(run / f"rank-{waiting}.jsonl", records)
        report = replay(run)
        if with_stop:
            assert report.sound, report.format()
            assert f"stop requested: SIGINT (rank {stopped}, step {end['step_id']})" in report.summary.notes[-1]
        else:
            kinds = {(v.kind, v.replica, v.ranks) for v in report.verdicts}
            assert ("hang", stopped, (stopped,)) in kinds, report.format()


@pytest.mark.parametrize("rank", [0, 3])
def test_a_fault_after_the_rank_s_own_stop_is_its_consequence_one_before_is_a_finding(tmp_path, rank):
    """An interrupted step logs a fault (vLLM's SystemExit raised inside `execute_model`): after
    the rank's stop record it is a note; the same fault before any request stays a `fault`.
    Mutation: `explains_fault` ignoring the order (seq) fails this."""
    for stop_first in (True, False):
        run = write_run(tmp_path / str(stop_first), SPEC)
        for other in range(4):
            _kill(run / f"rank-{other}.jsonl", stop_at=LATE + other)
        path = run / f"rank-{rank}.jsonl"
        records = _records(path)
        stop = records.pop()
        fault = {**stop, "event": "fault", "error": "SystemExit", "message": "interrupted"}
        for key in ("source", "signal", "detail"):
            del fault[key]
        fault["t_ns"] = LATE + 100 if stop_first else 500  # before every peer's request too
        records += [stop, fault] if stop_first else [fault, stop]
        _write(path, records)
        report = replay(run)
        if stop_first:
            assert report.sound, report.format()
            assert f"rank {rank} at step {LAST}: SystemExit: interrupted" in report.summary.notes[-1]
        else:  # the job was failing before anyone asked it to stop: nothing is explained
            assert ("fault", (rank,)) in [(v.kind, v.ranks) for v in report.verdicts], report.format()
            assert "all follow a fault" in report.summary.notes[-1]


def test_a_request_on_another_host_explains_no_end_by_time(tmp_path):
    """Monotonic clocks of two hosts cannot be compared: a stop recorded on host A says nothing
    of when a rank on host B died. Mutation: `_same_host` always true fails this."""
    run = write_run(tmp_path / "run", DP_ONLY)
    for rank, host in ((0, "a"), (1, "b")):
        path = run / f"rank-{rank}.jsonl"
        records = _records(path)
        records[0]["host"] = host  # the `job` record
        _write(path, records)
    end = _kill(run / "rank-1.jsonl")
    _kill(run / "rank-0.jsonl", stop_at=end["t_ns"] - 10)
    report = replay(run)
    assert [(v.kind, v.ranks) for v in report.verdicts] == [("unfinished", (1,))], report.format()


@pytest.mark.parametrize("recorded", [0, 1])
def test_every_member_inside_a_collective_when_one_recorded_the_stop(tmp_path, recorded):
    """Ctrl-C while both replicas wait in the step's expert exchange (both issued it): one
    records SIGINT there, the other, blocked in C++, is killed first. Nobody is to blame and the
    group was whole at the request: SOUND with a note. Without the record, or with the record
    after a fault of its own, the hang stays. Mutation seen to fail this: `stopped_inside`
    returning False."""
    silent = 1 - recorded
    for case in ("recorded", "no record", "after a fault"):
        run = write_run(tmp_path / case.replace(" ", "-"), DP_ONLY)
        for rank in (recorded, silent):
            path = run / f"rank-{rank}.jsonl"
            records = _inside_last_expert_exchange(path)
            last = records[-1]
            if rank == recorded and case == "after a fault":
                header = {k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}
                records.append({**header, "t_ns": last["t_ns"] + 5, "event": "fault", "step_id": LAST,
                                "error": "RuntimeError", "message": "Connection reset by peer"})
            if rank == recorded and case != "no record":
                records.append(_stop_record(last, LAST, last["t_ns"] + 10))
            _write(path, records)
        report = replay(run)
        hangs = [(v.kind, v.step, v.ranks) for v in report.verdicts if v.kind == "hang"]
        if case == "recorded":
            assert report.sound, report.format()
            assert f"stop requested: SIGINT (rank {recorded}, step {LAST})" in report.summary.notes[-1]
            assert "rank(s) 0, 1 ended after it" in report.summary.notes[-1]
        else:
            assert hangs == [("hang", LAST, (0, 1))], (case, report.format())


def _past_last_expert_exchange(path) -> list[dict]:
    """A rank's records up to its `done` of the last step's expert exchange."""
    records = _records(path)
    done = next(i for i, r in enumerate(records) if r["step_id"] == LAST and r.get("group") == "expert"
                and r.get("stage") == "done")
    return records[: done + 1]


@pytest.mark.parametrize("recorded", [0, 1])
def test_a_member_past_the_collective_recorded_the_stop_its_peer_blocked_in_it(tmp_path, recorded):
    """Ctrl-C (CI, `test_stop_requested[ctrl-c]`): one replica went past the step's expert
    exchange and recorded SIGINT in that step; the other, still inside the exchange (blocked in
    C++), was killed before it recorded anything. Nobody is to blame (both issued it; the one
    past it holds its peer's part): SOUND with a note naming both ends. Without the record, with
    the record after a fault of its own, at another step, or with the recording member ending
    in a later collective (whoever it waits for there may be dead), the hang stays. Mutation
    seen to fail this: `stopped_inside` asking only the ranks waiting in the collective."""
    silent = 1 - recorded
    cases = ("recorded", "no record", "after a fault", "another step", "waits in a later collective")
    for case in cases:
        run = write_run(tmp_path / case.replace(" ", "-"), DP_ONLY)
        _write(run / f"rank-{silent}.jsonl", _inside_last_expert_exchange(run / f"rank-{silent}.jsonl"))
        path = run / f"rank-{recorded}.jsonl"
        records = _past_last_expert_exchange(path)
        if case == "waits in a later collective":
            later = _records(path)[len(records):]
            records += later[: next(i for i, r in enumerate(later) if r.get("stage") == "enqueue") + 1]
        last = records[-1]
        if case == "after a fault":
            header = {k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}
            records.append({**header, "t_ns": last["t_ns"] + 5, "event": "fault", "step_id": LAST,
                            "error": "RuntimeError", "message": "Connection reset by peer"})
        if case != "no record":
            records.append(_stop_record(last, LAST - 1 if case == "another step" else LAST, last["t_ns"] + 10))
        _write(path, records)
        report = replay(run)
        hangs = [(v.kind, v.step, v.replica) for v in report.verdicts if v.kind == "hang"]
        if case == "recorded":
            assert report.sound, report.format()
            (note,) = [n for n in report.summary.notes if n.startswith("stop requested")]
            assert note.startswith(f"stop requested: SIGINT (rank {recorded}, step {LAST})"), note
            assert f"rank(s) {silent} ended after it" in note or "rank(s) 0, 1 ended after it" in note, note
            assert "a death" not in note, note
        else:
            assert (("hang", LAST, silent) in hangs
                    or ("unfinished", (silent,)) in [(v.kind, v.ranks) for v in report.verdicts]), \
                (case, report.format())
            assert not report.sound, (case, report.format())


@pytest.mark.parametrize("killed", [0, 1])
def test_a_rank_killed_inside_a_collective_before_the_stop_is_named(tmp_path, killed):
    """Done-when (d) as the logs show it: one worker SIGKILLed inside the expert exchange; its
    peer fails in it (gloo: connection reset), then vLLM shuts that peer down (its `stop` comes
    after the fault). The hang blames the peer it saw fail; the killed rank is named as a death.
    Mutation seen to fail this: `left_on_request` ignoring the peer's fault before its stop
    (the hang then reads explained, and the killed rank goes unnamed)."""
    peer = 1 - killed
    run = write_run(tmp_path / "run", DP_ONLY)
    for rank in (killed, peer):
        path = run / f"rank-{rank}.jsonl"
        records = _inside_last_expert_exchange(path)
        if rank == peer:
            last = records[-1]
            t = last["t_ns"]
            header = {k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}
            records += [{**header, "t_ns": t + 10, "event": "fault", "step_id": LAST, "error": "RuntimeError",
                         "message": "Connection reset by peer"},
                        {**header, "t_ns": t + 20, "event": "transition", "step_id": LAST, "trigger": "fault",
                         "src": "ready", "dst": "faulted", "outcome": "ok"},
                        _stop_record(last, LAST, t + 30, signal=None),
                        {**header, "t_ns": t + 40, "event": "transition", "step_id": LAST, "trigger": "shutdown",
                         "src": "faulted", "dst": "stopped", "outcome": "ok"}]
        _write(path, records)
    report = replay(run)
    assert not report.sound
    deaths = [(v.replica, v.step) for v in report.verdicts if v.kind == "unfinished" and v.ranks == (killed,)]
    assert deaths == [(killed, LAST)], report.format()
    assert "died there" in next(v.detail for v in report.verdicts if v.kind == "unfinished")


@pytest.mark.parametrize("first", [0, 1])
def test_stops_after_a_fault_are_the_failure_s_end_not_a_request(tmp_path, first):
    """Done-when (f)'s logs: the workers of one replica fail mid-step, vLLM then shuts every
    worker down (each records the shutdown call), and the other replica's workers fail on the
    closed connections, some after their own shutdown record. Nothing is explained: every fault
    stays. Mutation seen to fail this: `requests` taking every stop record (the later faults then
    read as the stop's consequence)."""
    other = 1 - first
    run = write_run(tmp_path / "run", DP_ONLY)
    for rank, fault_at, stop_at in ((first, 100, 110), (other, 130, 120)):
        path = run / f"rank-{rank}.jsonl"
        records = [r for r in _records(path) if not (r["event"] == "transition" and r["trigger"] == "shutdown")]
        last, base = records[-1], LATE
        header = {k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}
        fault = {**header, "t_ns": base + fault_at, "event": "fault", "step_id": LAST, "error": "AssertionError",
                 "message": f"rank {rank} failed"}
        stop = _stop_record(last, LAST, base + stop_at, signal=None)
        records += sorted([fault, stop], key=lambda r: r["t_ns"])
        _write(path, records)
    report = replay(run)
    faults = sorted(v.ranks for v in report.verdicts if v.kind == "fault")
    assert faults == [(0,), (1,)], report.format()
    assert any("all follow a fault" in note for note in report.summary.notes), report.summary.notes
