"""Missing evidence is never SOUND: every log opens with the job's shape, and replay requires a
log from every rank it names (`missing_rank`); Flight-Recorder-only replay requires a dump from
every rank the dumps name; unreadable input is one line on stderr and exit status 2."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.replay.judge import replay
from runner_fsm.audit.shape import Coords, JobShape, coords_of, global_rank_of, job_shape_fields, layout_groups
from runner_fsm.cli import main
from runner_fsm.testing.synth import SynthSpec, write_run

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6)


def _run(tmp_path, spec=SPEC):
    return write_run(tmp_path / "run", spec)


def test_the_shape_is_the_first_record_with_groups(tmp_path):
    shape = job_shape_fields(2, 2, dp_rank=1, pcp_rank=1)
    with AuditLog(tmp_path, "run-9", global_rank=3, dp_rank=1, pcp_rank=1, shape=shape) as audit:
        audit.transition(-1, "capture", "init", "capturing", "ok")
    first, second = read_records(tmp_path / "rank-3.jsonl")
    assert (first["seq"], first["event"], first["step_id"], first["run_id"]) == (0, "job", None, "run-9")
    assert (first["dp_size"], first["pcp_size"], first["world_size"], first["global_rank"]) == (2, 2, 4, 3)
    assert (first["dp_rank"], first["pcp_rank"]) == (1, 1)
    assert first["groups"] == {"dp": [1, 3], "pcp": [2, 3], "expert": [0, 1, 2, 3]}
    assert first["coords"] == {"dp": 1, "pp": 0, "pcp": 1, "tp": 0} and (first["tp_size"], first["pp_size"]) == (1, 1)
    assert isinstance(first["host"], str) and first["host"] and isinstance(first["pid"], int)
    assert first["schema"] == 2 and second["seq"] == 1
    assert JobShape.from_record(first) == JobShape("run-9", 2, 2, 4)


def test_shape_fields_take_a_worker_s_own_groups_and_refuse_header_names(tmp_path):
    fields = job_shape_fields(1, 2, 0, 1, groups={"pcp": [0, 1]}, supplied=["cpu all_to_all"])
    assert fields["groups"] == {"pcp": [0, 1]} and fields["supplied"] == ["cpu all_to_all"]
    with pytest.raises(ValueError, match="world_size"):
        job_shape_fields(1, 1, 0, 0, world_size=3)
    with pytest.raises(ValueError, match="reserved"):
        AuditLog(tmp_path, "r", 0, 0, 0, shape={"seq": 4})
    assert not (tmp_path / "rank-0.jsonl").exists()


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_any_one_deleted_log_is_a_missing_rank(tmp_path, capsys, rank):
    run = _run(tmp_path)
    (run / f"rank-{rank}.jsonl").unlink()
    assert main(["replay", str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    [verdict] = data["verdicts"]
    replica, pcp_rank = divmod(rank, 2)
    assert (verdict["kind"], verdict["replica"], verdict["ranks"]) == ("missing_rank", replica, [rank])
    assert f"rank {rank} (dp {replica}, pcp {pcp_rank}) left no audit log" in verdict["detail"]
    assert verdict["coords"] == [{"rank": rank, "dp": replica, "pp": 0, "pcp": pcp_rank, "tp": 0}]
    assert data["summary"]["expected_ranks"] == 4 and data["summary"]["ranks"] == 3
    assert main(["replay", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"replay {run}: 3 of 4 ranks (2 replicas x 2 PCP)")
    assert "UNSOUND: 1 finding(s); first: missing_rank" in out


def test_a_whole_missing_replica_is_two_missing_ranks_and_keeps_the_shape(tmp_path, capsys):
    run = _run(tmp_path)
    for rank in (2, 3):
        (run / f"rank-{rank}.jsonl").unlink()
    report = replay(run)
    assert [(v.kind, v.replica, v.ranks) for v in report.verdicts] == [("missing_rank", 1, (2,)),
                                                                       ("missing_rank", 1, (3,))]
    assert (report.summary.replicas, report.summary.pcp_size, report.exit_code) == (2, 2, 1)


def test_logs_without_a_shape_are_judged_from_the_files_with_a_note(tmp_path):
    run = _run(tmp_path, SynthSpec(dp_size=2, pcp_size=2, steps=6, job_shape=False))
    (run / "rank-3.jsonl").unlink()
    report = replay(run)
    assert report.sound  # nothing in these logs says the job had a fourth rank
    assert report.summary.expected_ranks is None
    [note] = report.summary.notes
    assert "no log begins with the job's shape" in note and note in report.format()


def test_a_sound_run_with_a_shape_has_no_note(tmp_path):
    report = replay(_run(tmp_path))
    assert report.sound and report.summary.notes == () and report.summary.expected_ranks == 4


def _rewrite_first(path, **changes):
    lines = path.read_bytes().splitlines(keepends=True)
    first = json.loads(lines[0])
    first.update(changes)
    lines[0] = json.dumps(first).encode() + b"\n"
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize("change, message", [
    (dict(dp_size=1, world_size=2), "its dp coordinate 1 is outside [0, 1)"),
    (dict(dp_size=3, world_size=6), "logs of different runs"),
    (dict(run_id="other"), "logs of different runs"),
    (dict(world_size=5), "not the product of its sizes"),
    (dict(tp_size=2), "not the product of its sizes"),
    (dict(coords={"dp": 0, "pp": 0, "pcp": 0, "tp": 3}), "tp coordinate 3 is outside [0, 1)"),
    (dict(dp_size="2"), "not a size"),
])
def test_logs_that_disagree_on_the_shape_are_unreadable_input(tmp_path, capsys, change, message):
    run = _run(tmp_path)
    _rewrite_first(run / "rank-2.jsonl", **change)
    assert main(["replay", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.splitlines()) == 1


def test_a_log_outside_the_shape_is_unreadable_input(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "rank-3.jsonl").rename(run / "rank-7.jsonl")
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert "rank-7.jsonl is not a rank of the job" in err and len(err.splitlines()) == 1


def test_a_log_at_the_wrong_coordinates_is_unreadable_input(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "rank-1.jsonl").rename(run / "rank-9.jsonl")
    (run / "rank-2.jsonl").rename(run / "rank-1.jsonl")
    (run / "rank-9.jsonl").rename(run / "rank-2.jsonl")
    assert main(["replay", str(run)]) == 2
    assert "its records say dp 1, pcp 0; the job run 'synth': dp=2 x pcp=2, world size 4 puts global rank 1" \
        " at dp 0, pcp 1" in capsys.readouterr().err


def test_a_log_that_is_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "rank-1.jsonl").unlink()
    (run / "rank-1.jsonl").mkdir()
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("runner-fsm replay: ReplayInputError: cannot read") and len(err.splitlines()) == 1


# ---------------------------------------------------------------- Flight Recorder dumps


def _nccl_style_dump(path, pg, ranks, seqs):
    """A torch dump whose pg_config lists the group's members (as torch writes for NCCL)."""
    path.write_text(json.dumps({
        "version": "2.10", "pg_config": {pg: {"name": pg, "desc": "undefined", "ranks": str(list(ranks))}},
        "pg_status": {"0": {"last_enqueued_collective": str(seqs), "last_completed_collective": str(seqs)}},
        "entries": [{"pg_id": 0, "process_group": [pg, "undefined"], "collective_seq_id": seq,
                     "profiling_name": "nccl:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"],
                     "retired": True, "time_created_ns": seq} for seq in range(1, seqs + 1)]}))


@pytest.mark.parametrize("deleted", [(3,), (0,), (2, 3)])
def test_flight_recorder_only_names_members_without_a_dump(tmp_path, capsys, deleted):
    for rank in range(4):
        if rank not in deleted:
            _nccl_style_dump(tmp_path / f"fr-rank-{rank}.json", "1", range(4), 3)
    assert main(["replay", str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [(v["kind"], v["ranks"]) for v in data["verdicts"]] == [("missing_rank", [r]) for r in deleted]
    assert all("lists it in group pg 1 (ranks 0, 1, 2, 3)" in v["detail"] for v in data["verdicts"])
    assert data["verdicts"][0]["evidence"] == ["flight_recorder"]
    assert data["summary"]["expected_ranks"] == 4


def test_flight_recorder_only_without_membership_counts_ranks_from_file_names(tmp_path):
    for rank in (0, 2):
        _nccl_style_dump(tmp_path / f"fr-rank-{rank}.json", "1", [], 2)
    report = replay(tmp_path)
    [verdict] = report.verdicts
    assert (verdict.kind, verdict.ranks) == ("missing_rank", (1,))
    assert "rank 2 dumped, and global ranks count from 0" in verdict.detail
    [note] = report.summary.notes
    assert "no group membership" in note and "above 2 cannot be seen" in note


@pytest.mark.parametrize("document", [
    {"entries": [{"pg_id": 0, "collective_seq_id": 1}]},  # no process_group: a KeyError on main
    {"entries": [{"pg_id": 0, "process_group": ["1"], "collective_seq_id": "one", "profiling_name": "x"}]},
    {"entries": [7]},
    {"format": "runner_fsm.process.flight_recorder/1", "groups": {"dp": {"ranks": [0]}}, "trace": {"entries": []}},
    {"pg_config": {"1": {"ranks": "[0, oops]"}}, "entries": []},
])
def test_a_malformed_dump_is_one_line_and_exit_2(tmp_path, capsys, document):
    _nccl_style_dump(tmp_path / "fr-rank-0.json", "1", range(2), 1)
    (tmp_path / "fr-rank-1.json").write_text(json.dumps(document))
    assert main(["replay", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("runner-fsm replay: ReplayInputError:") and "fr-rank-1.json" in captured.err
    assert len(captured.err.splitlines()) == 1


def test_a_malformed_dump_beside_logs_is_one_line_and_exit_2(tmp_path, capsys):
    run = _run(tmp_path)
    (run / "fr-rank-0.json").write_text(json.dumps({"entries": [{"pg_id": 0, "collective_seq_id": 1}]}))
    assert main(["replay", str(run)]) == 2
    assert "fr-rank-0.json: malformed Flight Recorder dump" in capsys.readouterr().err


def test_logs_without_a_shape_still_see_a_rank_the_dumps_name(tmp_path):
    run = _run(tmp_path, SynthSpec(dp_size=2, pcp_size=2, steps=6, job_shape=False))
    (run / "rank-3.jsonl").unlink()
    for rank in range(3):  # the runner's dumps: each names the members of its groups
        (run / f"fr-rank-{rank}.json").write_text(json.dumps({
            "format": "runner_fsm.process.flight_recorder/1", "global_rank": rank, "reason": "end",
            "groups": {"expert": {"pg_name": "5", "ranks": [0, 1, 2, 3]}}, "trace": {"entries": []}}))
    [verdict] = replay(run).verdicts
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("missing_rank", 1, (3,))
    assert "fr-rank-0.json lists it in group expert (ranks 0, 1, 2, 3)" in verdict.detail
    assert verdict.evidence == ("audit", "flight_recorder")


# ---------------------------------------------------------------- every dimension (Part 19)


def _vllm_layout(dp, pp, pcp, tp):
    """vLLM's rank layout, written out as vllm/distributed/parallel_state.py builds its groups:
    the ranks reshaped to [dp, pp, pcp, tp]; a dimension's groups by moving it last."""
    ranks = np.arange(dp * pp * pcp * tp).reshape(1, dp, pp, pcp, tp)
    groups = {"tp": ranks.reshape(-1, tp), "pcp": ranks.transpose(0, 1, 2, 4, 3).reshape(-1, pcp),
              "pp": ranks.transpose(0, 1, 4, 3, 2).reshape(-1, pp), "dp": ranks.transpose(0, 4, 2, 3, 1).reshape(-1, dp)}
    return ranks[0], groups


@pytest.mark.parametrize("sizes", [(2, 1, 2, 2), (1, 2, 1, 2), (3, 2, 2, 2), (2, 1, 1, 4)])
def test_coordinates_and_groups_are_vllms(sizes):
    """Mutation seen failing: `coords_of` with PCP as the fastest dimension (the old
    `rank % pcp_size` rule)."""
    ranks, groups = _vllm_layout(*sizes)
    dims = Coords(*sizes)
    for index in np.ndindex(*sizes):
        rank = int(ranks[index])
        assert global_rank_of(Coords(*index), dims) == rank and coords_of(rank, dims) == Coords(*index)
        mine = layout_groups(Coords(*index), dims)
        for name, rows in groups.items():
            [row] = [r for r in rows.tolist() if rank in r]
            assert mine[name] == row, (name, rank)


def test_the_shape_names_tp_and_pp_and_their_groups(tmp_path):
    fields = job_shape_fields(2, 2, dp_rank=1, pcp_rank=0, tp_size=2, tp_rank=1, pp_size=1, host="node-b",
                              hosts={"node-a": [0, 1, 2, 3], "node-b": [4, 5, 6, 7]})
    assert (fields["world_size"], fields["global_rank"]) == (8, 5)
    assert fields["coords"] == {"dp": 1, "pp": 0, "pcp": 0, "tp": 1}
    assert fields["groups"] == {"dp": [1, 5], "pcp": [5, 7], "tp": [4, 5], "expert": list(range(8))}
    assert fields["hosts"] == {"node-a": [0, 1, 2, 3], "node-b": [4, 5, 6, 7]} and fields["host"] == "node-b"
    shape = JobShape.from_record({"run_id": "r", **fields})
    assert shape == JobShape("r", 2, 2, 8, tp_size=2) and shape.coords(5) == Coords(1, 0, 0, 1)
    assert shape.text() == "run 'r': dp=2 x pcp=2 x tp=2, world size 8"


@pytest.mark.parametrize("spec", [SynthSpec(dp_size=2, pcp_size=1, tp_size=2, steps=5),
                                  SynthSpec(dp_size=2, pcp_size=2, tp_size=2, steps=5)])
def test_a_run_with_tp_ranks_replays_sound(tmp_path, spec):
    report = replay(write_run(tmp_path / "run", spec))
    assert report.sound, report.format()
    assert report.summary.expected_ranks == report.summary.ranks == 2 * spec.pcp_size * 2


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_a_missing_tp_rank_is_named_by_its_coordinates(tmp_path, rank):
    """Mutation seen failing: `_missing` naming the rank by `divmod(rank, pcp_size)` (TP ignored)."""
    run = write_run(tmp_path / "run", SynthSpec(dp_size=2, pcp_size=2, tp_size=2, steps=5))
    (run / f"rank-{rank}.jsonl").unlink()
    [verdict] = replay(run).verdicts
    dp, pp, pcp, tp = (int(v) for v in np.argwhere(_vllm_layout(2, 1, 2, 2)[0] == rank)[0])
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("missing_rank", dp, (rank,))
    assert f"rank {rank} (dp {dp}, pcp {pcp}, tp {tp}) left no audit log" in verdict.detail
    assert verdict.as_dict()["coords"] == [{"rank": rank, "dp": dp, "pp": pp, "pcp": pcp, "tp": tp}]
    assert f"rank {rank} (pcp {pcp}, tp {tp})" in str(verdict)


@pytest.mark.parametrize("lost", [None, 0, 5])
def test_replay_groups_ranks_as_vllm_does_even_without_a_rank_s_job_record(tmp_path, lost):
    """Each group instance replay compares is vLLM's (the `job` records' member lists); a rank
    whose record is lost is placed by its peers' lists or, failing those, by its coordinates.
    Mutation seen failing: `Groups.instance` keying `dp` by the PCP rank alone (the old rule:
    TP ranks of different DP groups merged)."""
    from runner_fsm.rules.ranks import Groups
    from runner_fsm.replay.discover import discover

    run = write_run(tmp_path / "run", SynthSpec(dp_size=2, pcp_size=2, tp_size=2, steps=3))
    if lost is not None:
        path = run / f"rank-{lost}.jsonl"
        path.write_bytes(path.read_bytes().split(b"\n", 1)[1])  # the job record gone
    groups = Groups(discover(run))
    _, expected = _vllm_layout(2, 1, 2, 2)
    for name in ("dp", "pcp", "tp"):
        for row in expected[name].tolist():
            for rank in row:
                assert groups.members(name, groups.instance(name, rank)) == tuple(row), (name, rank)


@pytest.mark.parametrize("replica", [0, 1])
def test_a_defect_in_a_tp_run_names_the_replica_and_every_rank_s_coordinates(tmp_path, replica):
    from runner_fsm.testing.synth import Defect

    spec = SynthSpec(dp_size=2, pcp_size=1, tp_size=2, steps=6)
    run = write_run(tmp_path / "run", spec, [Defect("collective_mismatch", replica, 3)])
    verdicts = [v for v in replay(run).verdicts if v.kind == "collective_mismatch"]
    assert verdicts and {(v.replica, v.step) for v in verdicts} == {(replica, 3)}
    ranks = {r for v in verdicts for r in v.ranks}
    assert ranks == {2 * replica, 2 * replica + 1}
    assert {(c["rank"], c["tp"]) for v in verdicts for c in v.as_dict()["coords"]} == \
        {(2 * replica, 0), (2 * replica + 1, 1)}


GOLDEN_SCHEMA1 = Path(__file__).parent / "golden" / "schema1-run"


def test_a_schema_1_log_still_replays(tmp_path):
    """Logs of the schema before Part 19 (stored, written by that version's synthesiser): their
    job records name no TP, PP, coordinates or host; they read as TP = PP = 1."""
    run = tmp_path / "run"
    shutil.copytree(GOLDEN_SCHEMA1, run)
    first = next(read_records(run / "rank-0.jsonl"))
    assert first["schema"] == 1 and "tp_size" not in first and "coords" not in first
    report = replay(run)
    assert report.sound and report.summary.expected_ranks == 4, report.format()
    (run / "rank-2.jsonl").unlink()
    [verdict] = replay(run).verdicts
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("missing_rank", 1, (2,))
    assert "rank 2 (dp 1, pcp 0) left no audit log" in verdict.detail


# --- --world-size beside audit logs, and with --plot: used or refused, never ignored ---------

def test_world_size_beside_logs_that_declare_the_shape_must_agree(tmp_path, capsys):
    """Mutation seen to fail this: `check_job` ignoring `world_size` (as before: silently dropped)."""
    run = _run(tmp_path)
    assert main(["replay", str(run), "--world-size", "4"]) == 0
    capsys.readouterr()
    assert main(["replay", str(run), "--world-size", "6"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--world-size 6 contradicts the job's shape, run 'synth': dp=2 x pcp=2, world size 4" in err


def test_world_size_names_the_missing_ranks_of_logs_without_a_shape(tmp_path, capsys):
    run = _run(tmp_path, SynthSpec(dp_size=2, pcp_size=2, steps=6, job_shape=False))
    (run / "rank-3.jsonl").unlink()
    report = replay(run, world_size=4)
    missing = [v for v in report.verdicts if v.kind == "missing_rank"]
    assert [(v.replica, v.ranks) for v in missing] == [(1, (3,))], report.format()
    assert "--world-size" in missing[0].detail and report.summary.notes[0].endswith("--world-size 4")
    assert main(["replay", str(run), "--world-size", "2"]) == 2  # rank-2.jsonl lies outside it
    assert "rank-2.jsonl lies outside --world-size 2" in capsys.readouterr().err


def test_world_size_is_used_with_plot_too(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path)
    assert main(["replay", str(run), "--plot", str(tmp_path / "t.png"), "--world-size", "6"]) == 2
    assert "contradicts the job's shape" in capsys.readouterr().err


def test_plot_of_flight_recorder_dumps_alone_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for rank in range(2):
        _nccl_style_dump(tmp_path / f"fr-rank-{rank}.json", "1", range(2), 2)
    assert main(["replay", str(tmp_path), "--plot", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds Flight Recorder dumps only" in err
