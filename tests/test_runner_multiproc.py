"""Two replicas x two PCP ranks on gloo: the real runner, the fake model, real agreements."""

import collections
from pathlib import Path

import pytest

from runner_fsm.audit import read_records
from runner_fsm.engine.launch import spawn
from runner_fsm.testing.scenarios import HANDOFF_LAYOUT, HANDOFF_SCRIPT, run_script

pytestmark = pytest.mark.multiproc

LAYOUT, SCRIPT = HANDOFF_LAYOUT, HANDOFF_SCRIPT


def _dp_collectives_per_step(run_dir: Path) -> dict[int, dict[int, list]]:
    """global rank -> step -> the (phase, stage) sequence of its DP collectives."""
    per_rank = {}
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        steps = collections.defaultdict(list)
        for rec in read_records(path):
            if rec["event"] == "collective" and rec["group"] == "dp":
                steps[rec["step_id"]].append((rec["phase"], rec["stage"]))
        per_rank[int(path.stem.split("-")[1])] = dict(steps)
    return per_rank


@pytest.mark.parametrize("k", [0, 2])
def test_prefill_while_peer_idles_same_collectives_everywhere(tmp_path, k):
    results = spawn(run_script, LAYOUT, str(tmp_path), {"num_speculative_tokens": k, "max_num_tokens": 64},
                    SCRIPT, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["error"] is None, (rank, result["error"])
        assert result["state"] == "stopped"
    # PCP ranks of a replica sample the same tokens; the idle replica ran dummies
    assert results[0]["outputs"] == results[1]["outputs"]
    assert results[0]["outputs"][0]["sampled"].keys() == {"req-0", "req-1"}
    assert [o["rows"] for o in results[2]["outputs"]] == [1, 1, 0, 3]  # 5-token prompt at P=2: chunks 2,2,1,0 -> N = 3
    assert results[2]["outputs"][2]["all_idle"]

    per_rank = _dp_collectives_per_step(tmp_path)
    reference = per_rank[0]
    agreements_per_step = 1 + (2 if k > 1 else 1 if k == 1 else 0)
    assert all(len(seq) == 2 * agreements_per_step for seq in reference.values())
    for rank, steps in per_rank.items():
        assert steps == reference, f"rank {rank} issued different DP collectives"


def test_skipped_draft_agreement_desyncs_every_replica_at_the_next_one(tmp_path):
    results = spawn(run_script, LAYOUT, str(tmp_path), {"num_speculative_tokens": 1, "max_num_tokens": 64},
                    SCRIPT, ("skip-draft-sync@replica=1,step=1",), timeout_s=60)
    for rank, result in enumerate(results):
        assert result["error"] is not None, rank
        assert result["error"]["type"] == "DesyncError", result["error"]
        assert "replica 1" in result["error"]["message"], result["error"]["message"]
        assert result["state"] == "faulted"
        # replica 1 finished step 1 without its draft; replica 0 was caught inside it
        assert len(result["outputs"]) == (2 if rank >= 2 else 1)
        assert "step 2" in result["error"]["message"] and "DRAFT_PREFILL" in result["error"]["message"]
