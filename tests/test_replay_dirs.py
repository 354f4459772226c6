"""A job on several machines is one run (Part 21): `runner-fsm replay A B ...` judges the
directories of its nodes together; a node whose directory is not given is `missing_rank`
naming its ranks and host; one rank's log found twice, or logs of different runs, are input
that cannot be judged (one line, exit status 2)."""

import json
import shutil

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.cli import main
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

NODES = ("node-a", "node-a", "node-b", "node-b")  # replica 0 on node-a, replica 1 on node-b
SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6, hosts=NODES)


def _split(tmp_path, spec=SPEC, defects=()):
    """The run's logs split by host into one directory per node, as each node writes its own."""
    run = write_run(tmp_path / "all", spec, defects)
    dirs = {}
    for rank, host in enumerate(spec.hosts):
        node = dirs.setdefault(host, tmp_path / host)
        node.mkdir(exist_ok=True)
        shutil.move(str(run / f"rank-{rank}.jsonl"), node / f"rank-{rank}.jsonl")
    return dirs["node-a"], dirs["node-b"]


def test_the_directories_of_a_job_replay_as_one_sound_run(tmp_path, capsys):
    a, b = _split(tmp_path)
    report = replay([a, b])
    assert report.sound and report.summary.ranks == report.summary.expected_ranks == 4, report.format()
    assert main(["replay", str(a), str(b)]) == 0
    assert capsys.readouterr().out.startswith(f"replay {a} + {b}: 4 ranks (2 replicas x 2 PCP)")


@pytest.mark.parametrize("given, missing, host", [("a", (2, 3), "node-b"), ("b", (0, 1), "node-a")])
def test_a_node_left_out_is_missing_ranks_named_with_their_host(tmp_path, given, missing, host):
    """Mutation seen failing: `hosts_of` reading each log's own `host` only (a missing rank's
    host is then unknown)."""
    a, b = _split(tmp_path)
    report = replay(a if given == "a" else b)
    assert [(v.kind, v.replica, v.ranks) for v in report.verdicts] == \
        [("missing_rank", missing[0] // 2, (r,)) for r in missing]
    for verdict, rank in zip(report.verdicts, missing):
        assert f"rank {rank} (dp {rank // 2}, pcp {rank % 2}) on host {host} left no audit log" in verdict.detail
        assert verdict.as_dict()["coords"][0]["host"] == host


@pytest.mark.parametrize("replica", [0, 1])
def test_a_fault_on_either_node_is_named_from_both_directories(tmp_path, replica):
    a, b = _split(tmp_path, defects=[Defect("collective_mismatch", replica, 3)])
    verdicts = replay([b, a]).verdicts
    assert {(v.kind, v.replica, v.step) for v in verdicts} == {("collective_mismatch", replica, 3)}


def test_one_rank_s_log_in_two_directories_is_unreadable_input(tmp_path, capsys):
    a, b = _split(tmp_path)
    shutil.copy(a / "rank-1.jsonl", b / "rank-1.jsonl")
    assert main(["replay", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"rank 1's audit log is in {a} and in {b} (rank-1.jsonl): one rank's audit log found twice" in err
    assert len(err.splitlines()) == 1


def test_directories_of_different_runs_are_unreadable_input(tmp_path, capsys):
    a, _ = _split(tmp_path / "one")
    _, other_b = _split(tmp_path / "two", SynthSpec(dp_size=2, pcp_size=2, steps=6, hosts=NODES, run_id="other"))
    assert main(["replay", str(a), str(other_b)]) == 2
    err = capsys.readouterr().err
    assert "logs of different runs given as one" in err and "'other'" in err and len(err.splitlines()) == 1


def test_flight_recorder_dumps_of_several_directories_are_joined(tmp_path, capsys):
    """Dumps alone (a plain PyTorch job), one directory per node."""
    for rank in range(4):
        node = tmp_path / NODES[rank]
        node.mkdir(exist_ok=True)
        (node / f"fr-rank-{rank}.json").write_text(json.dumps({
            "version": "2.10", "pg_config": {"1": {"name": "1", "desc": "undefined", "ranks": "[0, 1, 2, 3]"}},
            "pg_status": {"0": {"last_enqueued_collective": "2", "last_completed_collective": "2"}},
            "entries": [{"pg_id": 0, "process_group": ["1", "undefined"], "collective_seq_id": s,
                         "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"],
                         "retired": True, "time_created_ns": s} for s in (1, 2)]}))
    assert main(["replay", str(tmp_path / "node-a"), str(tmp_path / "node-b")]) == 0
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "node-a"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [(v["kind"], v["ranks"]) for v in data["verdicts"]] == [("missing_rank", [2]), ("missing_rank", [3])]
