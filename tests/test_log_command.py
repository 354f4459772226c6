"""`runner-fsm log RUN_DIR`: every record in full, one JSON object per line, across the rotated and
compressed segments of a capped log, rank by rank; `--rank`, `--steps A:B` (both included) and
`--last N` (per rank) choose which.

The run is synthetic (`SynthSpec(max_log_bytes=..., compress_segments=True)`: written through
`AuditLog` itself), DP=2 x PCP=2, long enough that each rank's oldest segments were rotated away;
replica 1 hangs at step 2450, so ranks 2 and 3 end one step before ranks 0 and 1. The expected
records are read here with `read_records` from the files themselves, found by name.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from runner_fsm.audit import read_records
from runner_fsm.audit.compact import KEYS as COMPACT_KEYS
from runner_fsm.audit.segments import MIN_SEGMENT
from runner_fsm.cli import main
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

SPEC = SynthSpec(dp_size=2, pcp_size=2, steps=2500, max_log_bytes=6 * MIN_SEGMENT, pinned_steps=20,
                 compress_segments=True)
HANG = 2450  # replica 1 (ranks 2, 3) never arrives: its log ends with step 2449, its peers' in 2450
HEADER = ("schema", "run_id", "seq", "t_ns", "dp_rank", "pcp_rank", "event", "step_id")
EVENT_FIELDS = {"transition": ("trigger", "src", "dst", "outcome"),
                "collective": ("group", "op", "phase", "shapes", "pg_seq", "stage"),
                "buffers": ("reason", "buffers"), "graph": ("action",), "fault": ("error", "message")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("log") / "run", SPEC, [Defect("hang", 1, HANG)])


def segment_files(run, rank):
    """The rank's kept segment files, by segment number, found by name (not by `ranklog`)."""
    found = [(int(m[1] or 0), name) for name in (p.name for p in run.iterdir())
             if (m := re.fullmatch(rf"rank-{rank}(?:\.(\d+))?\.jsonl(?:\.gz)?", name))]
    return [run / name for _, name in sorted(found)]


def full_records(run, rank):
    """What the full reader yields for the rank, segment by segment, as JSON gives it back."""
    return [json.loads(json.dumps(r)) for path in segment_files(run, rank) for r in read_records(path)]


def windowed(run, rank, first, last):
    """The rank's records of steps first..last, each segment's `job` record before its first one."""
    out = []
    for path in segment_files(run, rank):
        kept = [r for r in read_records(path) if isinstance(r["step_id"], int) and first <= r["step_id"] <= last]
        if kept:
            out += [json.loads(json.dumps(r)) for r in [next(read_records(path))] + kept]
    return out


def printed(capsys, *args) -> list[dict]:
    code = main(["log", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return [json.loads(line) for line in captured.out.splitlines()]


def test_the_fixture_has_rotated_compressed_and_plain_segments(run):
    """What the other tests stand on: every rank lost its oldest segments, kept compressed ones,
    a plain rotated one (its newest, still open when the run ended) and segment 0's head."""
    for rank in range(4):
        names = [p.name for p in segment_files(run, rank)]
        numbers = [int(re.search(r"\.(\d+)\.jsonl", n)[1]) for n in names[1:]]
        assert names[0] == f"rank-{rank}.jsonl" and numbers[0] > 1, names  # 1..k-1 rotated away
        assert all(n.endswith(".jsonl.gz") for n in names[1:-1]) and len(names) > 4
        assert re.fullmatch(rf"rank-{rank}\.\d+\.jsonl", names[-1])


def test_every_record_of_every_rank_in_full_in_global_rank_order(run, capsys):
    """Mutations: ranks in file-listing order, a segment left out, the compact records printed as
    stored -> the lists differ."""
    out = printed(capsys, run)
    assert out == [r for rank in range(4) for r in full_records(run, rank)]
    assert [r["seq"] for r in out if r["dp_rank"] == 1 and r["pcp_rank"] == 1] == \
        sorted(r["seq"] for r in out if r["dp_rank"] == 1 and r["pcp_rank"] == 1)
    for record in out:
        assert all(field in record for field in HEADER), record
        assert record["schema"] == 2 and record["run_id"] == "synth"
        assert all(field in record for field in EVENT_FIELDS.get(record["event"], ())), record
        if record["event"] != "job":
            assert not COMPACT_KEYS & set(record), record
    assert {r["event"] for r in out} >= {"job", "transition", "collective", "buffers", "graph"}
    buffers = next(r for r in out if r["event"] == "buffers")["buffers"]
    assert all({"ptr", "shape", "version"} <= set(b) for b in buffers.values())


def test_one_rank(run, capsys):
    out = printed(capsys, run, "--rank", 2)
    assert out == full_records(run, 2)
    assert {(r["dp_rank"], r["pcp_rank"]) for r in out} == {(1, 0)}
    assert out[-1]["step_id"] == HANG - 1


def test_steps_across_a_segment_boundary_include_both_ends(run, capsys):
    """A window over the end of one compressed segment and the start of the next: both segments'
    `job` records, each before its own records; A and B both included. Mutations: B excluded, a
    segment skipped by an off-by-one on its first or last step -> other records."""
    second = next(read_records(segment_files(run, 1)[2]))  # the second compressed segment's job record
    start = second["first_step"]
    out = printed(capsys, run, "--rank", 1, "--steps", f"{start - 1}:{start + 1}")
    assert out == windowed(run, 1, start - 1, start + 1)
    jobs = [i for i, r in enumerate(out) if r["event"] == "job"]
    assert len(jobs) == 2 and jobs[0] == 0 and out[jobs[1]]["segment"] == second["segment"]
    assert {r["step_id"] for r in out[1:jobs[1]]} == {start - 1}
    assert {r["step_id"] for r in out[jobs[1] + 1:]} == {start, start + 1}


def test_steps_of_every_rank(run, capsys):
    out = printed(capsys, run, "--steps", "2300:2302")
    assert out == [r for rank in range(4) for r in windowed(run, rank, 2300, 2302)]
    assert [r["global_rank"] for r in out if r["event"] == "job"] == [0, 1, 2, 3]


def test_last_is_counted_per_rank(run, capsys):
    """Ranks 0 and 1 end in step 2450 (waiting in its agreement), ranks 2 and 3 in step 2449: each
    rank's own last two steps. Mutation: one window for every rank (from the run's last step, as
    replay's --last) -> ranks 2 and 3 show one step only."""
    out = printed(capsys, run, "--last", 2)
    assert out == [r for rank in range(4) for r in windowed(run, rank, *((HANG - 1, HANG) if rank < 2
                                                                              else (HANG - 2, HANG - 1)))]
    steps = {}
    for r in out:
        if r["event"] != "job":
            steps.setdefault((r["dp_rank"], r["pcp_rank"]), set()).add(r["step_id"])
    assert steps == {(0, 0): {HANG - 1, HANG}, (0, 1): {HANG - 1, HANG},
                     (1, 0): {HANG - 2, HANG - 1}, (1, 1): {HANG - 2, HANG - 1}}
    assert out[-1]["event"] == "transition" and out[-1]["trigger"] == "finish"  # rank 3's last step ends
    rank_0 = [r for r in out if (r["dp_rank"], r["pcp_rank"]) == (0, 0)]
    assert rank_0[-1]["event"] == "collective" and rank_0[-1]["stage"] == "enqueue"  # where it hangs


def test_last_with_rank(run, capsys):
    out = printed(capsys, run, "--rank", 3, "--rank", 0, "--last", 1)
    assert out == windowed(run, 0, HANG, HANG) + windowed(run, 3, HANG - 1, HANG - 1)


def test_a_window_of_rotated_steps_prints_nothing_and_says_so(run, capsys):
    assert main(["log", str(run), "--steps", "10:20"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"runner-fsm log: no record of {run} lies in the window\n"


def test_the_start_up_records_of_segment_0_s_head(run, capsys):
    """Step -1 (the graph captures) is kept at the head of segment 0 however much was rotated."""
    out = printed(capsys, run, "--rank", 0, "--steps=-1:-1")  # "=": argparse takes "-1" for a flag
    assert out == windowed(run, 0, -1, -1) and out[0]["event"] == "job" and out[0]["segment"] == 0
    assert [r["trigger"] for r in out if r["event"] == "transition"][:2] == ["capture", "captured"]


def test_a_missing_run_directory_is_exit_2_with_one_line(tmp_path, capsys):
    assert main(["log", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"runner-fsm log: LogInputError: run directory {tmp_path / 'nope'} does not exist\n"


def test_a_directory_without_logs_is_exit_2(tmp_path, capsys):
    assert main(["log", str(tmp_path)]) == 2
    assert f"no rank-<global_rank>.jsonl files in {tmp_path}" in capsys.readouterr().err


def test_an_unknown_rank_is_exit_2_naming_the_ranks_there(run, capsys):
    assert main(["log", str(run), "--rank", "0", "--rank", "7"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"runner-fsm log: LogInputError: no audit log of rank 7 in {run} (its logs are of ranks 0-3)\n"


@pytest.mark.parametrize("flags, message", [(["--last", "0"], "expected a positive number of steps"),
                                            (["--steps", "5:2"], "expected --steps A:B with A <= B"),
                                            (["--last", "2", "--steps", "1:2"], "not allowed with argument")])
def test_a_bad_window_is_a_usage_error(run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["log", str(run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_closed_pipe_ends_the_output_quietly(run):
    """`runner-fsm log RUN | head -1`: the reader goes after one line (megabytes are left to
    print); no traceback, exit status 0. Mutation: BrokenPipeError not caught -> a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "runner_fsm.cli", "log", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""
    assert first["event"] == "job" and first["global_rank"] == 0


def test_a_folder_of_runs_is_exit_2_naming_them(tmp_path, capsys):
    """`runner-fsm log runs/demo`: the runs are in its sub-folders; the message names them."""
    for name in ("a", "b"):
        write_run(tmp_path / "logs" / name, SynthSpec(dp_size=1, pcp_size=1, steps=2))
    assert main(["log", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"runner-fsm log: LogInputError: {tmp_path} holds 2 run directories, not one"
                                       f" run ({tmp_path / 'logs' / 'a'}, {tmp_path / 'logs' / 'b'}): give one\n")
