"""DP=2 x PCP=2 through vLLM's own Model Runner V2 (four processes), with the tiny MLA MoE model
(DeepSeek-V2 shaped): replica 1 runs out of work early, so its dummy forwards run under PCP.

- sound: tokens equal DP=1 x PCP=1 through FSMWorker (vLLM's default CPU worker cannot run
  this: the stride-safe MLA rotary and the CPU MoE collectives are FSMWorker's); the idle
  replica's dummy forwards carry PCP evidence built for the dummy; replay finds nothing;
- each PCP fault of `inject`, injected through vLLM: `runner-fsm replay --json` over the logs
  with every `fault` record stripped names the kind, the replica and the step from the PCP
  evidence alone.

The children run MRV2 whichever leg runs this module (their environment says so), hence it
runs once (`runner_independent`). All runs start together in one fixture: each takes about
two minutes alone on the 2-core box.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import vllm_dp_cases as c
from vllm_checks import mrv2_env, pid_writing

import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job
from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

MRV2_ENV = mrv2_env(VLLM_CPU_OMP_THREADS_BIND="0|1|0|1")
PCP = 2
IDLE = 1  # the replica of PER_RANK that runs out of work (after step 1)
# kind -> (replica, step): the dummy faults on the idle replica's first dummy (step 2: the
# context and buffers before it are the last real batch's); the count on the
# prefill of step 0 (a single decode's count is the same locally and globally), on replica 0, so
# that both replicas are named by some case. (The count on the last replica too cost one more
# DP=2 x PCP=2 run, six processes that each import vLLM, which CI's 90 minutes could not pay.)
INJECTED = {f"{kind}@replica={replica},step={step}": (kind, replica, step) for kind, replica, step in [
    ("stale-pcp-context", IDLE, 2), ("skip-buffer-refresh", IDLE, 2), ("wrong-dispatch-count", 0, 0)]}
VERDICT = {"stale-pcp-context": "stale_context", "skip-buffer-refresh": "stale_buffer_replay",
           "wrong-dispatch-count": "dispatch_mismatch"}


TIMEOUT_S = 60  # collective_timeout_s


def _kwargs(model: str, run_dir: Path, pcp: int, inject: str | None = None) -> dict:
    options = {"collective_timeout_s": TIMEOUT_S}
    if inject:
        options["inject"] = inject
    return h.llm_kwargs(model, run_dir=str(run_dir), block_size=MLA_BLOCK_SIZE,
                        prefill_context_parallel_size=pcp, runner_fsm=options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pcp-dp")
    model = make_model(root / "deepseek_v2", "deepseek_v2", seed=3)
    cases = {"reference": (1, 1, [c.ALL], None), "sound": (2, PCP, c.PER_RANK, None)}
    for label in INJECTED:
        cases[label] = (2, PCP, c.PER_RANK, label)  # the label is the injection
    out = {}

    def one(label: str) -> None:
        dp, pcp, per_rank, inject = cases[label]
        run_dir = root / f"run-{label.replace('@', '-').replace('=', '').replace(',', '-')}"
        started = time.monotonic()
        result = c.run([Job(_kwargs(model, run_dir, pcp, inject), per_rank)], dp, root, timeout_s=1200, env=MRV2_ENV)
        out[label] = (result, run_dir, time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(label,)) for label in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for label, (_, _, took) in out.items():
        print(f"\n{label!r}: {took:.0f} s")
    return out


def _tokens(result) -> dict:
    merged = {}
    for rank_outputs in result.outputs[0]:
        merged.update(rank_outputs or {})
    return merged


def _records(run_dir: Path, rank: int) -> list[dict]:
    return c.records(run_dir / f"rank-{rank}.jsonl")


def test_dp2_pcp2_tokens_equal_dp1_pcp1_and_replay_is_sound(runs):
    reference, _, _ = runs["reference"]
    sound, run_dir, _ = runs["sound"]
    assert reference.codes == [0] and sound.codes == [0, 0], (sound.codes, sound.logs[0][-3000:])
    assert "Using V2 Model Runner" in sound.logs[0]
    assert _tokens(sound) == _tokens(reference) and set(_tokens(sound)) == {"long", "mid", "short"}
    code, verdicts = c.replay_json(run_dir)
    assert (code, verdicts) == (0, [])


def test_idle_replicas_dummies_carry_pcp_evidence_built_for_the_dummy(runs):
    _, run_dir, _ = runs["sound"]
    for rank in (IDLE * PCP, IDLE * PCP + 1):  # both PCP ranks of the idle replica
        records = _records(run_dir, rank)
        idle_steps = {r["step_id"] for r in records if r["event"] == "transition" and r["trigger"] == "idle"
                      and r["outcome"] == "ok"}
        assert idle_steps, "replica 1 ran no dummy step"
        forwards = {r["step_id"]: r for r in records if r["event"] == "collective" and r["op"] == "forward"
                    and r["stage"] == "enqueue"}
        for step in idle_steps:
            fwd = forwards[step]
            assert fwd["batch"] == fwd["ctx"] and fwd["ctx"]["step"] == step and fwd["ctx"]["dummy"] is True
            assert fwd["graph"] is False
        # the dummy's PCP buffers are logged before its forward, with their write counters
        dummy_buffers = [r for r in records if r["event"] == "buffers" and r["reason"] == "dummy"]
        assert {r["step_id"] for r in dummy_buffers} == idle_steps
        assert {"pcp.input_ids", "pcp.positions", "pcp.query_start_loc", "pcp.seq_lens",
                "pcp.slot_mapping"} <= set(dummy_buffers[0]["buffers"])
        # the real steps' TARGET agreements carry the dispatch count's inputs
        assert any("inputs" in r for r in records if r["event"] == "collective" and r["group"] == "dp")


def test_stripping_alone_leaves_no_finding(runs):
    """The sound run's logs stripped the same way still replay sound: a finding in a stripped
    faulty run is the evidence's, not the stripping's (it made `seq` gaps before, each a `gap`,
    enough for exit 1). Mutation seen to fail this: `vllm_dp_cases.stripped` keeping the old `seq`."""
    _, run_dir, _ = runs["sound"]
    code, verdicts = c.replay_json(c.stripped(run_dir))
    assert (code, verdicts) == (0, [])


@pytest.mark.parametrize("label", list(INJECTED))
def test_replay_names_the_injected_pcp_fault_from_the_evidence(runs, label):
    """Mutation seen to fail this: scan's `_dispatch_evidence` / `_forward_evidence` returning at
    once (the finding is then missing, though the run still exits 1: the job names an injection
    no `injected` record says acted, once those are stripped)."""
    result, run_dir, _ = runs[label]
    kind, replica, step = INJECTED[label]
    stripped = c.stripped(run_dir)
    assert not any(r["event"] in c.CONFESSIONS for rank in range(2 * PCP) for r in _records(stripped, rank))
    code, verdicts = c.replay_json(stripped)
    print(f"\n{label}: codes {result.codes}; replay: " + "; ".join(
        f"{v['kind']} replica {v['replica']} step {v['step']}" for v in verdicts))
    assert code == 1
    found = {(v["kind"], v["replica"], v["step"]) for v in verdicts}
    expected = VERDICT[kind]
    assert (expected, replica, step) in found, verdicts
    assert not any(v["kind"] == "gap" for v in verdicts), verdicts  # the stripped copy is whole
    # nothing is blamed on the replica that ran soundly
    assert all(v["replica"] in (replica, None) for v in verdicts if v["kind"] == expected), verdicts


FAILING = [label for label, (kind, _, _) in INJECTED.items() if kind == "wrong-dispatch-count"]


@pytest.mark.parametrize("label", FAILING)
def test_every_process_ends_soon_after_one_replica_fails(runs, label):
    """Done-when (f): the workers of one replica raise mid-step (vLLM's own DPMetadata assert on
    the count the injection sends, on both PCP ranks); every process of the job, both DP
    processes and their PCP workers, has ended within collective_timeout_s + 30 s of the
    first fault, none by the launcher's deadline; replay names the replica and step."""
    result, run_dir, _ = runs[label]
    kind, replica, step = INJECTED[label]
    faults = [r for rank in range(2 * PCP) for r in _records(run_dir, rank) if r["event"] == "fault"]
    assert {r["dp_rank"] for r in faults if r["error"] == "AssertionError"} == {replica}, faults
    failed_s = min(r["t_ns"] for r in faults) / 1e9  # CLOCK_MONOTONIC, as `ended_at`
    assert None not in result.codes, result.codes  # None: killed at the launcher's deadline
    after = [at - failed_s for at in result.ended_at]
    assert max(after) <= TIMEOUT_S + 30, after
    assert not [rank for rank in range(2 * PCP) if pid_writing(run_dir / f"rank-{rank}.jsonl")]  # no worker left
    code, verdicts = c.replay_json(run_dir)
    assert code == 1 and ("dispatch_mismatch", replica, step) in {(v["kind"], v["replica"], v["step"]) for v in verdicts}
