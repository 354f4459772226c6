"""`runner-fsm replay DIR` where DIR holds several runs (`make demo` leaves three in
`runs/demo/logs/<stamp>-.../`): each run judged on its own, one line each, exit status 0 when
every run is sound, 1 when any has findings, 2 when any cannot be read; `--json` a list of
per-run reports. One run, or the node directories of one job, are judged as before.

The runs are synthetic (`SynthSpec`), every one with the run id `synth`, as every run of the
embedded engine is `run`: the run id alone does not tell runs apart.
"""

from __future__ import annotations

import json
import shutil

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.replay.runs import find_runs, run_dirs_below
from runner_fsm.cli import main
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6)
NODES = SynthSpec(dp_size=2, pcp_size=2, steps=6, hosts=("node-a", "node-a", "node-b", "node-b"))  # two nodes


def demo_like(root, defects_of_b=()):
    """`root` laid out as `runner-fsm demo` lays out runs/demo: models beside a folder of runs."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text("{}")
    a = write_run(root / "logs" / "1-seed-1", SynthSpec(dp_size=2, pcp_size=2, steps=6, seed=1))
    b = write_run(root / "logs" / "2-seed-0", SPEC, defects_of_b)
    return a, b


def split_by_host(staging, target, spec, nodes):
    """The run `spec` written in `staging`, its logs moved into `target/<host>` for the `nodes` given."""
    whole = write_run(staging, spec)
    for rank, host in enumerate(spec.hosts):
        if host in nodes:
            (target / host).mkdir(parents=True, exist_ok=True)
            shutil.move(str(whole / f"rank-{rank}.jsonl"), target / host)
    return [target / host for host in nodes]


def as_json(data):
    return json.loads(json.dumps(data))  # tuples as lists


def replayed(capsys, *args) -> tuple[int, str]:
    code = main(["replay", *map(str, args)])
    return code, capsys.readouterr().out


def test_a_folder_of_two_sound_runs(tmp_path, capsys):
    """Two runs of one shape, both `synth`. Mutation: the run id and shape taken as the job (ranks
    that overlap not told apart) -> one run, rank 0's log found twice, exit 2."""
    a, b = demo_like(tmp_path)
    code, out = replayed(capsys, tmp_path)
    assert code == 0
    assert out.splitlines() == [f"replay: {tmp_path} holds 2 runs",
                                f"  {a}: run_id synth, 4 ranks: SOUND",
                                f"  {b}: run_id synth, 4 ranks: SOUND"]


@pytest.mark.parametrize("kind", ["gap", "missing_replica"])
def test_a_run_with_a_finding_is_exit_1_and_its_line_names_the_kind(tmp_path, capsys, kind):
    a, b = demo_like(tmp_path, [Defect(kind, 1, 3)])
    counts = replay(b).counts()
    assert kind in counts
    code, out = replayed(capsys, tmp_path)
    assert code == 1
    findings = sum(counts.values())
    assert out.splitlines() == [
        f"replay: {tmp_path} holds 2 runs",
        f"  {a}: run_id synth, 4 ranks: SOUND",
        f"  {b}: run_id synth, 4 ranks: {findings} finding{'s' if findings > 1 else ''}: "
        + ", ".join(f"{n} {k}" for k, n in counts.items()),
        "each run's findings: runner-fsm replay <its directories>"]


def test_json_is_a_list_of_per_run_reports(tmp_path, capsys):
    a, b = demo_like(tmp_path, [Defect("gap", 0, 2)])
    code, out = replayed(capsys, tmp_path, "--json")
    data = json.loads(out)
    assert code == 1 and [(r["run"], r["dirs"], r["run_id"], r["exit_code"]) for r in data] == \
        [(str(a), [str(a)], "synth", 0), (str(b), [str(b)], "synth", 1)]
    assert data[0]["summary"]["sound"] and data[0]["verdicts"] == []
    assert data[1]["summary"]["counts"]["gap"] >= 1 and data[1]["verdicts"][0]["kind"] == "gap"
    assert data[1] == {"run": str(b), "dirs": [str(b)], "run_id": "synth", "exit_code": 1, **as_json(replay(b).as_dict())}


def test_the_nodes_of_one_job_in_a_folder_are_one_run(tmp_path, capsys):
    """A job on two machines copied into one folder, one directory per node, beside another run:
    two runs, the job's line naming both directories. Mutation: each directory its own run ->
    three lines, two of them with missing ranks."""
    node_a, node_b = split_by_host(tmp_path / "staging", tmp_path / "runs" / "job", NODES, ["node-a", "node-b"])
    other = write_run(tmp_path / "runs" / "other", SPEC)
    code, out = replayed(capsys, tmp_path / "runs")
    assert code == 0
    assert out.splitlines() == [f"replay: {tmp_path / 'runs'} holds 2 runs",
                                f"  {node_a} + {node_b}: run_id synth, 4 ranks: SOUND",
                                f"  {other}: run_id synth, 4 ranks: SOUND"]


def test_halves_of_two_jobs_whose_hosts_differ_are_two_runs(tmp_path, capsys):
    """One run id, one shape, ranks that do not overlap, but each job's `job` records list other
    hosts: two runs, each missing the ranks of its other node. Mutation: the hosts not compared
    -> one sound run."""
    one = SynthSpec(dp_size=2, pcp_size=2, steps=6, hosts=("a1", "a1", "a2", "a2"))
    two = SynthSpec(dp_size=2, pcp_size=2, steps=6, hosts=("b1", "b1", "b2", "b2"))
    (a1,) = split_by_host(tmp_path / "one", tmp_path / "runs", one, ["a1"])
    (b2,) = split_by_host(tmp_path / "two", tmp_path / "runs", two, ["b2"])
    code, out = replayed(capsys, tmp_path / "runs")
    assert code == 1
    assert out.splitlines()[1:3] == [f"  {a1}: run_id synth, 2 of 4 ranks: 2 findings: 2 missing_rank",
                                     f"  {b2}: run_id synth, 2 of 4 ranks: 2 findings: 2 missing_rank"]


def test_no_run_is_looked_for_inside_a_run(tmp_path):
    """A run directory is a run, whatever lies below it (a copy kept inside it is not listed)."""
    a, b = demo_like(tmp_path)
    shutil.copytree(b, a / "copy")
    assert run_dirs_below(tmp_path) == [a, b]


def test_directories_that_are_each_a_whole_run(tmp_path, capsys):
    """`runner-fsm replay runs/demo/logs/*`: before, rank 0's log found twice (exit 2)."""
    a, b = demo_like(tmp_path, [Defect("gap", 1, 3)])
    code, out = replayed(capsys, a, b)
    assert code == 1
    lines = out.splitlines()
    assert lines[:3] == ["replay: the 2 directories given are 2 runs", f"  {a}: run_id synth, 4 ranks: SOUND",
                         lines[2]] and lines[2].startswith(f"  {b}: run_id synth, 4 ranks: ") and "gap" in lines[2]


def test_a_run_that_cannot_be_read_is_exit_2_and_the_others_are_judged(tmp_path, capsys):
    """A directory with the logs of two jobs of different shapes: that run is unreadable (replay
    alone exits 2 on it); its neighbour is still judged."""
    a, b = demo_like(tmp_path)
    mixed = tmp_path / "logs" / "3-mixed"
    mixed.mkdir()
    alone = write_run(tmp_path / "staging", SynthSpec(dp_size=1, pcp_size=1, steps=6))
    shutil.copy(alone / "rank-0.jsonl", mixed / "rank-0.jsonl")
    shutil.copy(b / "rank-1.jsonl", mixed / "rank-1.jsonl")
    code, out = replayed(capsys, tmp_path)
    assert code == 2
    lines = out.splitlines()
    assert lines[1:3] == [f"  {a}: run_id synth, 4 ranks: SOUND", f"  {b}: run_id synth, 4 ranks: SOUND"]
    assert lines[3].startswith(f"  {mixed}: UNREADABLE: ") and "logs of different runs given as one" in lines[3]
    assert main(["replay", str(mixed)]) == 2


def test_options_for_one_run_are_refused(tmp_path, capsys):
    demo_like(tmp_path)
    assert main(["replay", str(tmp_path), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"runner-fsm replay: ReplayInputError: --plot is for one run; {tmp_path} holds 2 runs")
    assert not (tmp_path / "x.png").exists()


def test_a_window_applies_to_every_run(tmp_path, capsys):
    demo_like(tmp_path, [Defect("gap", 1, 1)])
    code, out = replayed(capsys, tmp_path, "--last", "3", "--json")
    data = json.loads(out)
    assert code == 0 and [r["summary"]["window"] for r in data] == [[3, 5], [3, 5]]


def test_one_run_is_judged_as_before(tmp_path, capsys):
    """The contract: one run directory, its report as `replay` formats it; --json one object."""
    _, b = demo_like(tmp_path, [Defect("gap", 1, 3)])
    assert find_runs(b) is None and find_runs([b]) is None
    code, out = replayed(capsys, b)
    assert code == 1 and out == replay(b).format() + "\n"
    code, out = replayed(capsys, b, "--json")
    assert code == 1 and json.loads(out) == as_json(replay(b).as_dict())


def test_a_folder_without_runs_is_unreadable_as_before(tmp_path, capsys):
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    assert find_runs(tmp_path / "empty") is None
    assert main(["replay", str(tmp_path / "empty")]) == 2
    assert "no rank-<global_rank>.jsonl files in" in capsys.readouterr().err


def test_nodes_given_one_by_one_are_still_one_job(tmp_path):
    """The nodes of one job given as directories are one run, not a list: none of them is whole."""
    nodes = split_by_host(tmp_path / "all", tmp_path, NODES, ["node-a", "node-b"])
    assert find_runs(nodes) is None
    assert main(["replay", *map(str, nodes)]) == 0
