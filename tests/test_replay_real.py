"""`runner-fsm replay` on the logs of real multi-process runs (2 replicas x 2 PCP ranks on gloo)."""

import json

import pytest

from runner_fsm.cli import main
from runner_fsm.engine.launch import spawn
from runner_fsm.testing.scenarios import HANDOFF_LAYOUT, HANDOFF_SCRIPT, run_script

pytestmark = pytest.mark.multiproc

LAYOUT, SCRIPT = HANDOFF_LAYOUT, HANDOFF_SCRIPT
CONFIG = {"num_speculative_tokens": 1, "max_num_tokens": 64}


def test_scripted_run_is_sound(tmp_path, capsys):
    results = spawn(run_script, LAYOUT, str(tmp_path), CONFIG, SCRIPT, timeout_s=60)
    assert all(r["error"] is None for r in results), results
    assert main(["replay", str(tmp_path)]) == 0, capsys.readouterr().out
    assert "SOUND" in capsys.readouterr().out


def test_skipped_draft_sync_is_named_with_replica_1_at_step_1(tmp_path, capsys):
    spawn(run_script, LAYOUT, str(tmp_path), CONFIG, SCRIPT, ("skip-draft-sync@replica=1,step=1",),
          timeout_s=60)
    assert main(["replay", str(tmp_path), "--json"]) == 1
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    first = verdicts[0]
    assert (first["kind"], first["replica"], first["step"]) == ("collective_mismatch", 1, 1), verdicts
    assert first["ranks"] == [2, 3]
    assert "skipped all_reduce DRAFT_PREFILL" in first["detail"]
    # the desync the runner caught online is listed too, after its cause
    assert {(v["kind"], v["replica"], v["step"]) for v in verdicts[1:]} == {("fault", 0, 1), ("fault", 1, 2)}


@pytest.mark.parametrize("deleted", [(0,), (3,), (2, 3)])
def test_a_deleted_log_of_a_real_run_is_a_missing_rank(tmp_path, capsys, deleted):
    spawn(run_script, LAYOUT, str(tmp_path), CONFIG, SCRIPT, timeout_s=60)
    for rank in deleted:
        (tmp_path / f"rank-{rank}.jsonl").unlink()
    assert main(["replay", str(tmp_path), "--json"]) == 1
    verdicts = json.loads(capsys.readouterr().out)["verdicts"]
    assert [(v["kind"], v["replica"], v["ranks"]) for v in verdicts] == [
        ("missing_rank", rank // 2, [rank]) for rank in deleted]
