"""A stop request recorded where it started (`stops-<host>-<pid>.jsonl`, vLLM's front process)
explains the ends it caused, with no clock compared across hosts (`rules.stops`, `replay.origins`).

Synthetic two-node runs (replica 0 on node A, replica 1 on node B, each node's log in a directory
of its own), cut as vLLM's default shutdown cuts them: the stopped node's worker killed inside a
collective before it could record anything (the kernel did not schedule it between the signal
and vLLM's SIGKILL), the other node's worker left with a connection reset by its peer. Each
case is run with either node stopped first, and with node B's clock an hour ahead.
"""

from __future__ import annotations

import json
import shutil

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.testing.logs import records_of, write_in_full
from runner_fsm.testing.synth import SynthSpec, write_run

HOSTS = ("nodeA", "nodeB")
SPEC = SynthSpec(dp_size=2, pcp_size=1, steps=6, hosts=HOSTS)
LAST = SPEC.steps - 1
HOUR_NS = 3600 * 10**9
RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41235: Connection reset by peer"


_records = records_of


def _write(path, records) -> None:
    """`records` renumbered (`seq` from 0) as the rank's log."""
    write_in_full(path, [{**record, "seq": seq} for seq, record in enumerate(records)])


def _inside_last_collective(records: list[dict]) -> list[dict]:
    """Up to its enqueue of the last step's expert exchange: it waits there when it is killed."""
    cut = next(i for i, r in enumerate(records) if r["step_id"] == LAST and r.get("group") == "expert"
               and r.get("stage") == "enqueue")
    return records[: cut + 1]


def _two_nodes(tmp_path, stopped: int, *, peer_fault: str | None = RESET, killed_first: bool = False,
               origin: bool = True, shift_b: int = 0):
    """Node `stopped`'s worker killed in the last step's collective, no record of its own; with
    `origin`, its front's request naming it alive. The other worker: a `fault` (`peer_fault`) in
    that step, then its log ends. `killed_first`: node `stopped` was SIGKILLed, no front recorded
    anything there, and the other node's front recorded its own Ctrl-C after its worker's fault."""
    run = write_run(tmp_path / "synth", SPEC)
    dirs = [tmp_path / "nodeA", tmp_path / "nodeB"]
    for rank, directory in enumerate(dirs):
        directory.mkdir()
        records = [r for r in _records(run / f"rank-{rank}.jsonl")
                   if not (r["event"] == "transition" and r.get("trigger") == "shutdown")]
        records = _inside_last_collective(records)
        if rank != stopped and peer_fault is not None:
            last = records[-1]
            records.append({**{k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}, "seq": 0,
                            "t_ns": last["t_ns"] + 50, "event": "fault", "step_id": LAST,
                            "error": peer_fault.split(":")[0], "message": peer_fault.split(": ", 1)[1]})
        _write(directory / f"rank-{rank}.jsonl", records)
    shutil.rmtree(run)
    end = {rank: _records(d / f"rank-{rank}.jsonl")[-1]["t_ns"] for rank, d in enumerate(dirs)}
    if origin:
        front = 1 - stopped if killed_first else stopped
        alive = [front] if killed_first else [stopped]
        request = {"event": "stop_request", "run_id": SPEC.run_id, "signal": None, "process": "vLLM's API server",
                   "host": HOSTS[front], "pid": 4242 + front, "t_ns": end[front] + 1000, "alive": alive, "gone": []}
        (dirs[front] / f"stops-{HOSTS[front]}-{4242 + front}.jsonl").write_text(json.dumps(request) + "\n")
    if shift_b:
        _shift(dirs[1], shift_b)
    return dirs


def _shift(directory, delta_ns: int) -> None:
    """Every time node B wrote, `delta_ns` later: its clock disagrees with node A's."""
    for path in directory.iterdir():
        if path.name.startswith("rank-"):
            _write(path, [{**r, "t_ns": r["t_ns"] + delta_ns} for r in _records(path)])
        else:
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({**r, "t_ns": r["t_ns"] + delta_ns}) + "\n" for r in lines))


@pytest.mark.parametrize("shift", [0, HOUR_NS, -HOUR_NS])
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_node_stopped_before_its_worker_could_record_reads_sound_naming_the_stop(tmp_path, stopped, shift):
    """Mutations seen to fail it: `alive_at_request` left empty (the stopped rank reads as a death,
    `hang`/`unfinished`); `_lost_peer_faults` returning nothing (the peer's reset stays a `fault`)."""
    report = replay(_two_nodes(tmp_path, stopped, shift_b=shift))
    assert report.sound, report.format()
    note = next(n for n in report.summary.notes if n.startswith("stop requested"))
    assert note.startswith(f"stop requested: a stop signal received by vLLM's API server (pid {4242 + stopped} on host"
                           f" {HOSTS[stopped]}), recorded there before any rank was stopped, with rank(s) {stopped}"
                           " alive then"), note
    assert f"rank {1 - stopped} at step {LAST}: RuntimeError" in note and "Connection reset by peer" in note, note


@pytest.mark.parametrize("stopped", [0, 1])
def test_without_the_origin_record_the_silent_rank_reads_as_a_death(tmp_path, stopped):
    """The same logs with the front's file missing: nothing says the stopped rank was asked to stop."""
    report = replay(_two_nodes(tmp_path, stopped, origin=False))
    assert not report.sound
    named = {(v.kind, v.ranks) for v in report.verdicts}
    assert ("fault", (1 - stopped,)) in named, report.format()
    assert any(kind in ("hang", "unfinished") and stopped in ranks for kind, ranks in named), report.format()


@pytest.mark.parametrize("shift", [0, HOUR_NS])
@pytest.mark.parametrize("killed", [0, 1])
def test_a_node_killed_before_the_ctrl_c_of_the_other_reads_as_its_death(tmp_path, killed, shift):
    """Node `killed` SIGKILLed (its front too: no request there); the other node's worker lost its
    connection, then that node was stopped with Ctrl-C. The reset follows a death, not a stop:
    the fault stays and the killed rank is named. Mutation seen to fail it: the front's request
    taken though it follows a fault on its host, with `_lost_peer_faults` counting the faulted
    rank itself as the peer that left (either alone still holds)."""
    report = replay(_two_nodes(tmp_path, killed, killed_first=True, shift_b=shift))
    assert not report.sound
    named = {(v.kind, v.ranks) for v in report.verdicts}
    assert ("fault", (1 - killed,)) in named, report.format()
    assert any(kind in ("hang", "unfinished") and killed in ranks for kind, ranks in named), report.format()


def test_a_fault_that_is_no_lost_connection_is_not_the_stop_s_consequence(tmp_path):
    """Only a lost connection follows from a peer's end: another error in the same step stays a
    fault, and the end of its rank a death (the hang it left waits on both)."""
    report = replay(_two_nodes(tmp_path, 0, peer_fault="ValueError: logits contain NaN"))
    assert ("fault", (1,)) in [(v.kind, v.ranks) for v in report.verdicts], report.format()
    assert "rank(s) 1 ended before any stop request was recorded: a death" in report.summary.notes[-1], report.format()


def test_an_origin_of_another_run_or_unreadable_is_not_counted_and_is_said(tmp_path):
    dirs = _two_nodes(tmp_path, 0, origin=False)
    other = {"event": "stop_request", "run_id": "another", "signal": "SIGINT", "process": "vLLM's API server",
             "host": "nodeA", "pid": 1, "t_ns": 10**15, "alive": [0], "gone": []}
    (dirs[0] / "stops-nodeA-1.jsonl").write_text(json.dumps(other) + "\n{not json\n")
    report = replay(dirs)
    assert not report.sound and "stop requested" not in " ".join(report.summary.notes), report.format()
    assert any("stops-nodeA-1.jsonl:2: not a stop request" in n for n in report.summary.notes), report.summary.notes


@pytest.mark.parametrize("case", ["no front's record", "front's record", "no front", "SIGINT"])
def test_a_sigterm_a_worker_records_is_a_request_only_where_its_front_recorded_one(tmp_path, case):
    """Both ranks recorded a signal, then were killed between steps. vLLM's executor SIGTERMs its
    workers however the engine ends (a crash it logged nowhere included): where the worker's
    front records requests (`stop_front` in its `job` record), a SIGTERM with no request from that
    front on its host is no stop. A SIGINT (vLLM sends none), a front's record, or a writer with
    no front reads as before. Mutation seen to fail it: `StopRule._asked` always True."""
    run = write_run(tmp_path / "run", SPEC)
    signal = "SIGINT" if case == "SIGINT" else "SIGTERM"
    for rank in range(2):
        path = run / f"rank-{rank}.jsonl"
        records = [r for r in _records(path) if not (r["event"] == "transition" and r.get("trigger") == "shutdown")]
        if case != "no front":
            records[0]["stop_front"] = True
        last = records[-1]
        records.append({**{k: last[k] for k in ("schema", "run_id", "dp_rank", "pcp_rank")}, "seq": 0,
                        "t_ns": 10**12 + rank, "event": "stop", "step_id": last["step_id"], "source": "signal",
                        "signal": signal, "detail": ""})
        _write(path, records)
        if case == "front's record":
            request = {"event": "stop_request", "run_id": SPEC.run_id, "signal": "SIGTERM", "process": "an LLM script",
                       "host": HOSTS[rank], "pid": 7 + rank, "t_ns": 10**12 - 1, "alive": [rank], "gone": []}
            (run / f"stops-{HOSTS[rank]}-{7 + rank}.jsonl").write_text(json.dumps(request) + "\n")
    report = replay(run)
    if case == "no front's record":
        assert {v.ranks for v in report.verdicts if v.kind == "unfinished"} == {(0,), (1,)}, report.format()
        assert "are SIGTERMs no front recorded a request for" in " ".join(report.summary.notes), report.format()
    else:
        assert report.sound, report.format()
