"""A replica agrees with itself through vLLM (Part 20): the TP ranks' drafter gate, MTP at TP=2 on
vLLM's own Model Runner V2 (one engine, two worker processes), a DeepSeek-V3-style MLA MoE with
one MTP layer from random weights.

- clean, `consensus` on: tokens equal HF transformers' greedy ones (MTP drafts never change
  greedy tokens); both ranks log every step's gate and digest; replay SOUND;
- `tp-skip-draft@replica=0,step=5,rank=1`, consensus off: rank 1's gate alone says no, and rank
  0's drafter waits in its TP all-reduce for a peer that never comes (vLLM #49027). The job is
  killed once that shows on disk (rank 1 ended step 5; rank 0 passed its gate and has not, 5 s
  later). Replay of the logs without their `fault` and `injected` records names
  `replica_divergence` at replica 0, step 5 (both ranks: with two, which one is wrong is not
  known), from the `gate` records;
- the same fault with `consensus` on, on the last rank and on the first: every rank stops at
  step 5 with a `DesyncError` naming the gates, before any drafter collective (no hang); replay of
  the stripped logs names the same.

The children run MRV2 whichever leg runs this module (their environment says so): once
(`runner_independent`).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import vllm_dp_cases as c
from vllm_checks import hf_greedy, mrv2_env

from runner_fsm.audit import read_records
from runner_fsm.replay.judge import replay
import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job
from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_mtp_model

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

STEP = 5
REQUESTS = c.PER_RANK[0]  # a 90-token prompt and a 23-token one: a prefill, then decodes past step 5
CASES = {  # label -> (inject, consensus)
    "clean": (None, True),
    "hang": (f"tp-skip-draft@replica=0,step={STEP},rank=1", False),
    "consensus-rank1": (f"tp-skip-draft@replica=0,step={STEP},rank=1", True),
    "consensus-rank0": (f"tp-skip-draft@replica=0,step={STEP},rank=0", True),
}
RUNS_AT_ONCE = 2  # three processes each


def _hung(run_dir: Path):
    """stop_when for the hang: rank 1 ended step STEP, rank 0 passed its gate there and has not
    ended it 5 s later."""
    seen = {}

    def check() -> bool:
        try:
            ended = _step_ended(run_dir, 1) and _gated(run_dir, 0) and not _step_ended(run_dir, 0)
        except (OSError, ValueError):
            return False
        if not ended:
            seen.pop("at", None)
            return False
        return time.monotonic() - seen.setdefault("at", time.monotonic()) > 5.0
    return check


def _records(run_dir: Path, rank: int) -> list[dict]:
    return list(read_records(run_dir / f"rank-{rank}.jsonl"))


def _step_ended(run_dir: Path, rank: int) -> bool:
    return any(r["event"] == "transition" and r["trigger"] == "finish" and r["step_id"] == STEP
               for r in _records(run_dir, rank))


def _gated(run_dir: Path, rank: int) -> bool:
    return any(r["event"] == "gate" and r["step_id"] == STEP for r in _records(run_dir, rank))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-tp-mtp")
    model = make_mtp_model(root / "mtp_moe", moe=True, seed=3)
    out, slots = {}, threading.Semaphore(RUNS_AT_ONCE)

    def one(label: str) -> None:
        injection, consensus = CASES[label]
        run_dir = root / f"run-{label}"
        options = {"collective_timeout_s": 60, "consensus": consensus, **({"inject": injection} if injection else {})}
        llm = h.llm_kwargs(model, run_dir=str(run_dir), block_size=MLA_BLOCK_SIZE, max_num_batched_tokens=256,
                           tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                           runner_fsm=options)
        with slots:
            started = time.monotonic()
            result = c.run([Job(llm, [REQUESTS])], 1, root, timeout_s=600,
                           env=mrv2_env(VLLM_CPU_OMP_THREADS_BIND="0|1"),
                           stop_when=_hung(run_dir) if label == "hang" else None)
            out[label] = (result, run_dir, time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(label,)) for label in CASES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for label, (_, _, took) in out.items():
        print(f"\n{label!r}: {took:.0f} s")
    hf = {}
    for rid, prompt, new_tokens in REQUESTS:
        hf.update(hf_greedy(model, {rid: list(prompt)}, new_tokens))
    return {"hf": hf, **out}


def _stripped_verdicts(run_dir: Path) -> list[tuple]:
    report = replay(c.stripped(run_dir))
    return [(v.kind, v.replica, v.step, v.ranks) for v in report.verdicts], report


def test_tp2_mtp_with_consensus_equals_hf_greedy_and_replays_sound(runs):
    """Mutation: `after_step` comparing another step's row -> DesyncError here; the exchanges
    not logged -> fails."""
    result, run_dir, _ = runs["clean"]
    assert result.codes == [0], result.logs[0][-3000:]
    assert "Using V2 Model Runner" in result.logs[0]
    tokens = result.outputs[0][0]
    assert tokens == runs["hf"]
    per_rank = [_records(run_dir, rank) for rank in range(2)]
    for records in per_rank:
        gates = {r["step_id"] for r in records if r["event"] == "gate"}
        finishes = {r["step_id"] for r in records if r["event"] == "transition" and r["trigger"] == "finish"}
        assert gates == finishes and len(gates) >= max(n for _, _, n in REQUESTS) - 1, (gates, finishes)
        assert records[0]["tp_size"] == 2 and records[0]["runner"] == "mrv2"
        # each step's two exchanges, logged like every collective, in the group the job record lists
        assert records[0]["groups"]["replica"] == [0, 1]
        exchanged = [(r["step_id"], r["op"], r["stage"]) for r in records
                     if r["event"] == "collective" and r["group"] == "replica"]
        assert exchanged == [(step, op, stage) for step in sorted(finishes) for op in ("gate", "decisions")
                             for stage in ("enqueue", "done")], exchanged
    assert replay(run_dir).sound, replay(run_dir).format()


def test_a_rank_that_skips_its_drafter_hangs_its_peer_and_replay_names_the_step(runs):
    """Done-when: consensus off, `tp-skip-draft@replica=0,step=5,rank=1`. Mutation: the gate
    record written with the step's other records at its end (as `draft` is) -> rank 0, stuck
    inside its drafter, has no gate at step 5 and replay names no divergence."""
    result, run_dir, took = runs["hang"]
    assert result.codes == [None], (result.codes, result.logs[0][-3000:])  # killed: it hung
    assert _step_ended(run_dir, 1) and not _step_ended(run_dir, 0)
    found, report = _stripped_verdicts(run_dir)
    assert found[0] == ("replica_divergence", 0, STEP, (0, 1)), report.format()
    assert {kind for kind, *_ in found} <= {"replica_divergence", "unfinished", "injection_not_fired"}, report.format()
    assert "rank 1 (dp 0, tp 1) decided draft=0" in report.verdicts[0].detail


@pytest.mark.parametrize("rank", [1, 0])
def test_consensus_stops_every_rank_at_the_gate_naming_it(runs, rank):
    """consensus on, the fault on the last rank and on the first: both ranks fault at step 5 with
    a DesyncError naming rank K's gate (draft=0), no hang; the stripped logs name the same.
    Mutation: `_gate` exchanging before it logs -> the same online, but replay names nothing."""
    result, run_dir, _ = runs[f"consensus-rank{rank}"]
    assert result.codes[0] not in (0, None), (result.codes, result.logs[0][-3000:])
    for r in range(2):
        faults = [x for x in _records(run_dir, r) if x["event"] == "fault"]
        assert faults and faults[0]["error"] == "DesyncError" and faults[0]["step_id"] == STEP, faults
        message = faults[0]["message"]
        assert re.search(rf"rank {rank} \(dp 0, tp {rank}\) decided draft=0", message), message
        assert "before the drafter's collectives" in message
    found, report = _stripped_verdicts(run_dir)
    assert found[0] == ("replica_divergence", 0, STEP, (0, 1)), report.format()
    assert f"rank {rank} (dp 0, tp {rank}) decided draft=0" in report.verdicts[0].detail
