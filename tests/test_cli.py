"""`runner-fsm` command line."""

import json
import subprocess
import sys

from runner_fsm.cli import main


def test_plan_prints_worked_example(capsys):
    assert main(["plan", "--pcp", "2", "--scheduled", "1,10", "--prefill", "0,1", "--computed", "37,0"]) == 0
    out = capsys.readouterr().out
    assert "tokens    0 | 10 | 1 2 3" in out
    assert "positions 37 | 3 4 5 | 6 7 8" in out
    assert "dispatch count N = 7" in out
    assert "hidden_restore_idx [0, 2, 3, 4, 8, 9, 10, 11, 12, 13, 1]" in out


def test_plan_json(capsys):
    assert main(["plan", "--pcp", "4", "--scheduled", "18", "--prefill", "1", "--chunking", "balanced", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_rank_num_tokens"] == [5, 5, 4, 4]


def test_plan_bad_input_exits_2_with_message():
    proc = subprocess.run(
        [sys.executable, "-m", "runner_fsm.cli", "plan", "--pcp", "2", "--scheduled", "1,10", "--prefill", "0"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "BatchError" in proc.stderr and "got lengths 2, 1, 2" in proc.stderr
