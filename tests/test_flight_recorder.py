"""PyTorch's Flight Recorder in runs and in replay.

- A plain PyTorch job (3 gloo processes, no runner) that leaves only its Flight Recorder dumps:
  replay names, per group, the first sequence number at which the ranks differ and the ranks
  behind, for a rank that stops early and for a rank that skips one collective.
- Real DP=2 x PCP=2 runs of the embedded engine with the `hang` and `skip-draft-sync`
  injections: every rank leaves `fr-rank-<r>.json`; replay's verdict names the culprit replica
  and step with evidence from both sources; the dumps alone name the same ranks for the hang.
- A real DP=3 run with `skip-draft-sync`: the agreement's phase-specific shape (`dp.wire_shape`)
  lets the dumps alone name the culprit's rank (the majority issued the draft agreement); with two
  members (DP=2) they say plainly that they cannot tell which side diverged.
- The two sources disagreeing is a finding; turning the recorder off is honoured.
"""

import json
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from runner_fsm.process import flight_recorder
from runner_fsm.replay.flight import read_dumps
from runner_fsm.replay.judge import ReplayInputError, replay
from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request

TIMEOUT_S = 3.0
WORKLOAD = [  # replica 1 owns one short request and idles from step 2 on (as in test_faults)
    Request("long", tuple(range(5, 41)), 14, 0, replica=0),
    Request("mid", tuple(range(50, 62)), 10, 1, replica=0),
    Request("short", tuple(range(70, 75)), 2, 0, replica=1),
]

# One rank of a plain gloo job: `counts[rank]` all_reduces on a group of every rank, each
# waited for only while every rank still joins; then its Flight Recorder dump, raw as torch
# renders it, and a wait until every rank has dumped (so no pending collective is broken
# by a peer leaving first).
_PLAIN_JOB = textwrap.dedent("""
    import json, os, sys, time
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch, torch.distributed as dist
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    counts = json.loads(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    tensor = torch.ones(4)
    works = [dist.all_reduce(tensor, group=group, async_op=True) for _ in range(counts[rank])]
    for work in works[:min(counts)]:
        work.wait()
    time.sleep(0.5)
    dump = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
    with open(os.path.join(out, f"fr-rank-{rank}.json.tmp"), "wb") as f:
        f.write(dump)
    os.replace(os.path.join(out, f"fr-rank-{rank}.json.tmp"), os.path.join(out, f"fr-rank-{rank}.json"))
    while len([n for n in os.listdir(out) if n.endswith(".json")]) < world:
        time.sleep(0.05)
    os._exit(0)
""")


def _plain_job(out_dir, counts):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _PLAIN_JOB, str(rank), str(len(counts)), str(port),
                               str(out_dir), json.dumps(counts)]) for rank in range(len(counts))]
    for proc in procs:
        assert proc.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def rank_2_skips_one_of_four(tmp_path_factory):
    """The dumps of one plain four-rank job whose rank 2 skips one of four all_reduces, for the
    tests that each delete some of them from a copy (four interpreters importing torch: once)."""
    out = tmp_path_factory.mktemp("plain-4-4-3-4")
    _plain_job(out, [4, 4, 3, 4])
    return out


@pytest.mark.multiproc
def test_flight_recorder_only_names_a_plain_job_s_rank_without_a_dump(rank_2_skips_one_of_four, tmp_path):
    shutil.copytree(rank_2_skips_one_of_four, tmp_path, dirs_exist_ok=True)
    (tmp_path / "fr-rank-1.json").unlink()
    report = replay(tmp_path)
    assert [(v.kind, v.ranks) for v in report.verdicts] == [("missing_rank", (1,)), ("hang", (2,))]
    # torch 2.13's gloo groups leave pg_config empty: the ranks come from the file names, said so
    assert "no group membership" in report.summary.notes[0]


@pytest.mark.multiproc
def test_a_plain_job_s_highest_ranks_without_dumps_need_the_world_size(rank_2_skips_one_of_four, tmp_path):
    """The issue's case: four ranks, rank 2 skips an all_reduce, the dumps of ranks 2 and 3
    deleted. The gloo dumps name no members, so only the user's --world-size can say the job
    had four ranks; given it, both are named; without it, the note says what cannot be seen."""
    shutil.copytree(rank_2_skips_one_of_four, tmp_path, dirs_exist_ok=True)
    for rank in (2, 3):
        (tmp_path / f"fr-rank-{rank}.json").unlink()
    report = replay(tmp_path, world_size=4)
    assert [(v.kind, v.ranks) for v in report.verdicts] == [("missing_rank", (2,)), ("missing_rank", (3,))]
    assert "the job's world size is 4 (--world-size)" in report.verdicts[0].detail and report.exit_code == 1
    blind = replay(tmp_path)
    assert blind.sound and "cannot be seen" in blind.summary.notes[0]
    with pytest.raises(ReplayInputError, match=r"rank\(s\) 1 lie outside --world-size 1"):
        replay(tmp_path, world_size=1)


@pytest.mark.multiproc
@pytest.mark.parametrize("counts, behind", [([3, 3, 2], (2,)),  # rank 2 stops before its 3rd
                                            ([4, 3, 4], (1,))])  # rank 1 skips one of four
def test_flight_recorder_only_names_the_rank_behind(tmp_path, counts, behind):
    _plain_job(tmp_path, counts)
    report = replay(tmp_path)
    assert report.exit_code == 1
    [verdict] = report.verdicts
    first = min(counts) + 1
    assert verdict.kind == "hang" and verdict.ranks == behind
    assert verdict.evidence == ("flight_recorder",)
    assert verdict.detail.startswith(f"first difference at #{first}:")
    ahead = [r for r in range(len(counts)) if r not in behind]
    assert f"started and never completed by rank(s) {', '.join(map(str, ahead))}" in verdict.detail


def _run(models, run_dir, injection, layout=ParallelLayout(2, 2)):
    target, draft = models
    cfg = EngineConfig(model_dir=target, draft_dir=draft, run_dir=str(run_dir), layout=layout,
                       num_speculative_tokens=1, collective_timeout_s=TIMEOUT_S, injections=(injection,))
    result = run_engine(cfg, WORKLOAD, timeout_s=120)
    assert not result.ok
    return run_dir


@pytest.fixture(scope="module")
def hang_run(models, tmp_path_factory):
    return _run(models, tmp_path_factory.mktemp("hang"), "hang@replica=1,step=4")


@pytest.mark.multiproc
def test_every_rank_dumps_beside_its_log(hang_run):
    dumps = read_dumps(hang_run)
    assert sorted(dumps) == [0, 1, 2, 3]
    assert {d.reason for d in dumps.values()} == {"timeout"}
    assert dumps[0].names[dumps[0].pg_of("dp")] == "dp" and dumps[0].members[dumps[0].pg_of("dp")] == (0, 2)


@pytest.mark.multiproc
def test_hang_verdict_joins_the_flight_recorder(hang_run):
    report = replay(hang_run)
    [hang] = [v for v in report.verdicts if v.kind == "hang"]
    assert (hang.replica, hang.step, hang.ranks) == (1, 4, (2, 3))
    assert hang.evidence == ("audit", "flight_recorder")
    # per the Flight Recorder: who never started the agreement; per the audit log: where each rank was
    assert "never started by rank(s) 2" in hang.detail and "never started by rank(s) 3" in hang.detail
    assert "started and never completed by rank(s) 0" in hang.detail
    assert "rank 2: in idle (ready -> idle_dummy) at step 4, which failed" in hang.detail
    assert not [v for v in report.verdicts if v.kind == "source_disagreement"]


@pytest.mark.multiproc
def test_flight_recorder_alone_names_the_same_ranks(hang_run, tmp_path):
    for dump in hang_run.glob("fr-rank-*.json"):
        shutil.copy(dump, tmp_path)
    report = replay(tmp_path)
    assert sorted(r for v in report.verdicts if v.kind == "hang" for r in v.ranks) == [2, 3]
    assert all(v.evidence == ("flight_recorder",) for v in report.verdicts)


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", [0, 3])
def test_a_rank_with_neither_log_nor_dump_is_a_missing_rank(hang_run, tmp_path, rank):
    shutil.copytree(hang_run, tmp_path / "run")
    (tmp_path / "run" / f"rank-{rank}.jsonl").unlink()
    (tmp_path / "run" / f"fr-rank-{rank}.json").unlink()
    missing = [v for v in replay(tmp_path / "run").verdicts if v.kind == "missing_rank"]
    assert [(v.replica, v.ranks) for v in missing] == [(rank // 2, (rank,))]
    assert f"rank {rank} (dp {rank // 2}, pcp {rank % 2}) left no audit log" in missing[0].detail


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_the_runner_s_dumps_alone_name_a_rank_without_a_dump(hang_run, tmp_path, rank):
    for dump in hang_run.glob("fr-rank-*.json"):
        if dump.name != f"fr-rank-{rank}.json":
            shutil.copy(dump, tmp_path)
    report = replay(tmp_path)
    missing = [v for v in report.verdicts if v.kind == "missing_rank"]
    assert [v.ranks for v in missing] == [(rank,)] and report.exit_code == 1
    assert "lists it in group" in missing[0].detail


@pytest.mark.multiproc
def test_sources_that_disagree_are_a_finding(hang_run, tmp_path):
    shutil.copytree(hang_run, tmp_path / "run")
    path = tmp_path / "run" / "fr-rank-0.json"
    dump = json.loads(path.read_text())
    pg = dump["groups"]["dp"]["pg_name"]
    for entry in dump["trace"]["entries"]:  # as if rank 0 had run one more unlogged agreement
        if entry["process_group"][0] == pg:
            entry["collective_seq_id"] += 1
    for status in dump["trace"]["pg_status"].values():
        status["last_enqueued_collective"] = str(int(status["last_enqueued_collective"]) + 1)
    path.write_text(json.dumps(dump))
    report = replay(tmp_path / "run")
    found = [v for v in report.verdicts if v.kind == "source_disagreement" and v.ranks == (0,)]
    assert found and "a collective ran unlogged" in found[0].detail
    assert found[0].evidence == ("audit", "flight_recorder")


def _one_fewer_in_the_dump(run, rank: int, group: str) -> None:
    """Rank `rank`'s dump as if torch never issued the last collective its log announced in `group`."""
    path = run / f"fr-rank-{rank}.json"
    dump = json.loads(path.read_text())
    pg = dump["groups"][group]["pg_name"]
    last = max(e["collective_seq_id"] for e in dump["trace"]["entries"] if e["process_group"][0] == pg)
    dump["trace"]["entries"] = [e for e in dump["trace"]["entries"]
                                if not (e["process_group"][0] == pg and e["collective_seq_id"] == last)]
    status = dump["trace"]["pg_status"][pg]
    status["last_enqueued_collective"] = str(int(status["last_enqueued_collective"]) - 1)
    path.write_text(json.dumps(dump))


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("stopped", [True, False])
def test_a_collective_announced_then_stopped_before_torch_is_no_disagreement(hang_run, tmp_path, rank, stopped):
    """A Ctrl-C lands between a collective's `enqueue` record and the call (the cancel takes effect
    at the wait for the group's thread): the log counts one more than torch. With the rank's own
    stop request on record, and that collective never logged done, that is the stop, not a
    disagreement of the sources. Without the stop it is one; and so it is for rank 2 (the hang's
    culprit), whose last agreement was logged done: torch had it, whatever came after. Mutation
    seen to fail it: `_disagreements` without the stop's case -> source_disagreement on rank 0."""
    run = tmp_path / "run"
    shutil.copytree(hang_run, run)
    _one_fewer_in_the_dump(run, rank, "dp")
    if stopped:
        with open(run / f"rank-{rank}.jsonl", "ab") as log:  # as a handler records it, after the enqueue
            log.write(b'{"t":1,"e":"stop","source":"signal","signal":"SIGINT","detail":""}\n')
    found = [v for v in replay(run).verdicts if v.kind == "source_disagreement"]
    if stopped and rank == 0:
        assert found == []
    else:
        assert [v.ranks for v in found] == [(rank,)]
        assert "the log announced a collective torch never issued" in found[0].detail


@pytest.mark.multiproc
def test_skip_draft_sync_verdict_joins_the_flight_recorder(models, tmp_path):
    _run(models, tmp_path, "skip-draft-sync@replica=1,step=4")
    report = replay(tmp_path)
    named = [v for v in report.verdicts if v.kind == "collective_mismatch" and (v.replica, v.step) == (1, 4)]
    assert named, report.format()
    assert named[0].evidence == ("audit", "flight_recorder")
    # gloo matched the culprit's next agreement with its peers' draft agreement (same seq):
    assert "matched by gloo as one collective, but the audit log says rank 0 as step 4 DRAFT_PREFILL;" \
           " rank 2 as step 5 TARGET" in named[0].detail
    assert "the Flight Recorder recorded gloo:all_reduce [[14]] Long on rank(s) 0; gloo:all_reduce" \
           " [[7, 2]] Long on rank(s) 2" in named[0].detail
    # The dumps alone: each DP group has two members, so no majority says which side diverged.
    only = tmp_path / "fr-only"
    only.mkdir()
    for dump in tmp_path.glob("fr-rank-*.json"):
        shutil.copy(dump, only)
    ties = replay(only).verdicts
    assert sorted(v.ranks for v in ties) == [(0, 2), (1, 3)], replay(only).format()
    assert all(v.kind == "collective_mismatch" and "cannot tell which side diverged" in v.detail for v in ties)


@pytest.fixture(scope="module")
def skip_run_dp3(models, tmp_path_factory):
    return _run(models, tmp_path_factory.mktemp("skip3"), "skip-draft-sync@replica=1,step=4", ParallelLayout(3, 1))


@pytest.mark.multiproc
def test_skip_draft_sync_at_dp3_joins_the_flight_recorder(skip_run_dp3):
    report = replay(skip_run_dp3)
    [named] = [v for v in report.verdicts if v.kind == "collective_mismatch"]
    assert (named.replica, named.step, named.ranks) == (1, 4, (1,))
    assert named.evidence == ("audit", "flight_recorder")
    assert "the Flight Recorder recorded gloo:all_reduce [[21]] Long on rank(s) 0, 2; gloo:all_reduce" \
           " [[7, 3]] Long on rank(s) 1" in named.detail
    # the online check, unchanged by the shapes gloo was handed: every rank stopped naming replica 1
    faults = [v for v in report.verdicts if v.kind == "fault"]
    assert sorted(v.replica for v in faults) == [0, 1, 2]
    assert all("expected step 4 DRAFT_PREFILL, odd one(s) out: replica(s) 1" in v.detail for v in faults)


@pytest.mark.multiproc
def test_skip_draft_sync_at_dp3_flight_recorder_alone_names_the_rank(skip_run_dp3, tmp_path):
    for dump in skip_run_dp3.glob("fr-rank-*.json"):
        shutil.copy(dump, tmp_path)
    report = replay(tmp_path)
    [verdict] = report.verdicts  # the expert group's uneven all_to_all sizes are no finding
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("collective_mismatch", None, (1,))
    assert verdict.evidence == ("flight_recorder",)
    assert "rank(s) 0, 2 issued gloo:all_reduce [[21]] Long; rank(s) 1 issued gloo:all_reduce [[7, 3]] Long);" \
           " rank(s) 1 diverged from the majority" in verdict.detail


def _torch_dump(path, pg, entries):
    """A dump as torch's `_dump_fr_trace_json` renders one (the fields replay reads)."""
    path.write_text(json.dumps({"entries": [
        {"pg_id": 0, "process_group": [pg, "default"], "collective_seq_id": seq, "profiling_name": op,
         "input_sizes": sizes, "input_dtypes": ["Long"], "retired": True, "time_created_ns": seq}
        for seq, op, sizes in entries]}))


def test_two_members_that_differ_are_named_both_never_guessed(tmp_path):
    same = [(1, "gloo:all_reduce", [[7, 2]]), (2, "gloo:all_reduce", [[14]])]
    _torch_dump(tmp_path / "fr-rank-0.json", "1", same + [(3, "gloo:all_reduce", [[14]])])
    _torch_dump(tmp_path / "fr-rank-1.json", "1", same + [(3, "gloo:all_reduce", [[7, 2]])])
    [verdict] = replay(tmp_path).verdicts
    assert (verdict.kind, verdict.replica, verdict.ranks) == ("collective_mismatch", None, (0, 1))
    assert verdict.detail == (
        "first difference at #3: group pg 1 (pg 1, ranks 0, 1) collective #3 differs between ranks (rank(s) 0"
        " issued gloo:all_reduce [[14]] Long; rank(s) 1 issued gloo:all_reduce [[7, 2]] Long); with no majority"
        " the Flight Recorder alone cannot tell which side diverged (a runner's audit logs, when the run left"
        " them, can)")


def test_turned_off_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(flight_recorder.DISABLE_ENV, "0")
    monkeypatch.setenv(flight_recorder.BUFFER_ENV, "100")  # off beats a size (and is undone after)
    assert flight_recorder.enable() is False
    # explicitly 0: unset, torch 2.13 records gloo collectives anyway (2000 entries by default)
    assert __import__("os").environ[flight_recorder.BUFFER_ENV] == "0"
    assert flight_recorder.dump_beside(tmp_path, 0, {}, "end") is None
    assert not list(tmp_path.iterdir())


_RECORDED = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from runner_fsm.process import flight_recorder
    flight_recorder.enable()  # before the first process group, as the workers call it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))
    print(len(json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])))
    # the group's threads joined before exit: without it gloo once ended the process with
    # "terminate called without an active exception" (seen in make test, 2026-12-01)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("switch, recorded", [(None, 1), ("0", 0)])
def test_off_means_torch_records_nothing(switch, recorded):
    import os

    env = {k: v for k, v in os.environ.items() if k not in (flight_recorder.DISABLE_ENV, flight_recorder.BUFFER_ENV)}
    if switch is not None:  # unset TORCH_FR_BUFFER_SIZE would be torch's default: recording
        env[flight_recorder.DISABLE_ENV] = switch
    out = subprocess.run([sys.executable, "-c", _RECORDED], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == recorded


def test_enable_sets_the_buffer_for_children_only(monkeypatch):
    monkeypatch.delenv(flight_recorder.DISABLE_ENV, raising=False)
    monkeypatch.delenv(flight_recorder.BUFFER_ENV, raising=False)
    import os

    with flight_recorder.enabled_for_children() as on:
        assert on and os.environ[flight_recorder.BUFFER_ENV] == str(flight_recorder.DEFAULT_BUFFER_SIZE)
    assert flight_recorder.BUFFER_ENV not in os.environ


def test_missing_dump_api_fails_clearly(monkeypatch):
    import torch

    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    monkeypatch.delenv(flight_recorder.DISABLE_ENV, raising=False)
    with pytest.raises(flight_recorder.FlightRecorderUnavailable, match="RUNNER_FSM_FLIGHT_RECORDER=0"):
        flight_recorder.enable()


def test_a_rank_without_the_dump_api_fails_at_its_start(monkeypatch):
    """`runner-fsm run`'s launcher turns the recorder on without loading torch; each rank checks
    the dump call before its first step (mutation: no check in `run_rank` -> the run goes on
    and fails only when a rank dumps)."""
    import torch

    from runner_fsm.engine.worker import run_rank

    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    monkeypatch.delenv(flight_recorder.DISABLE_ENV, raising=False)
    monkeypatch.setenv(flight_recorder.BUFFER_ENV, "2000")  # as `enabled_for_children` leaves it
    with pytest.raises(flight_recorder.FlightRecorderUnavailable, match="RUNNER_FSM_FLIGHT_RECORDER=0"):
        run_rank(object(), None, [])  # a rank's groups; nothing of the run is reached


@pytest.mark.multiproc
def test_hang_in_the_trace(hang_run, tmp_path):
    from runner_fsm.replay.perfetto import export_perfetto

    export_perfetto(hang_run, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    step4 = [e for e in events if e["ph"] == "X" and e["args"].get("step") == 4]
    # the culprit's ranks stalled in their step's transition for the whole timeout
    stalled = {e["tid"]: e["dur"] for e in step4 if e["name"] == "idle_dummy (failed)"}
    assert sorted(stalled) == [2, 3] and min(stalled.values()) >= 0.9 * TIMEOUT_S * 1e6
    # its peers' agreement never completed
    waiting = [e for e in step4 if e["name"] == "dp all_reduce TARGET"]
    assert sorted(e["tid"] for e in waiting) == [0, 1] and not any(e["args"]["completed"] for e in waiting)
    findings = [e for e in events if e["name"] == "finding: hang"]
    assert sorted(e["tid"] for e in findings) == [2, 3]
    assert all(e["args"]["evidence"] == ["audit", "flight_recorder"] for e in findings)
