"""A replay finds its run once (`replay.discover.Run`): the judgement, the Flight Recorder join,
the timeline picture and the Perfetto trace all read the same `Run`, so each rank's files are
listed and probed once however many of them a command asks for."""

import json

import pytest

from runner_fsm.cli import main
from runner_fsm.replay import discover as discover_module
from runner_fsm.testing.synth import SynthSpec, write_run

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=6)


def _dump(path, rank):
    """A Flight Recorder dump of `rank` whose DP group ran two agreements (seq 1, 2)."""
    path.write_text(json.dumps({
        "version": "2.10", "pg_config": {"1": {"name": "dp", "desc": "undefined", "ranks": "[0, 2]"}},
        "pg_status": {"0": {"last_enqueued_collective": "2", "last_completed_collective": "2"}},
        "entries": [{"pg_id": 0, "process_group": ["1", "dp"], "collective_seq_id": s,
                     "profiling_name": "gloo:all_reduce", "input_sizes": [[7, 2]], "input_dtypes": ["Long"],
                     "retired": True, "time_created_ns": s} for s in (1, 2)]}))


@pytest.fixture
def probes(monkeypatch):
    """Every rank file a replay probes, in order (`discover._probe`, once per rank per discovery)."""
    seen = []
    probe = discover_module._probe

    def counted(path):
        seen.append(path.name)
        return probe(path)
    monkeypatch.setattr(discover_module, "_probe", counted)
    return seen


@pytest.mark.parametrize("extra", ([], ["--perfetto", "trace.json"], ["--plot", "plot.png"]),
                         ids=("replay", "perfetto", "plot"))
def test_a_replay_probes_each_rank_once(tmp_path, probes, extra, capsys):
    """With Flight Recorder dumps beside the logs (their join read the ranks again) and the
    trace or the picture asked for too (each found the run again): 4 ranks, 4 probes."""
    run = write_run(tmp_path / "run", SPEC)
    for rank in range(4):
        _dump(run / f"fr-rank-{rank}.json", rank)
    extra = [str(tmp_path / arg) if arg.endswith((".json", ".png")) else arg for arg in extra]
    code = main(["replay", str(run), "--json", *extra])
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["ranks"] == 4 and code in (0, 1)
    assert sorted(probes) == [f"rank-{rank}.jsonl" for rank in range(4)]


def test_a_folder_of_runs_probes_each_rank_once(tmp_path, probes, capsys):
    """Listing the runs of a folder finds each run; judging it does not find it again."""
    for name in ("a", "b"):
        write_run(tmp_path / "runs" / name, SPEC)
    assert main(["replay", str(tmp_path / "runs")]) == 0
    assert "holds 2 runs" in capsys.readouterr().out
    assert len(probes) == 8
