"""Prefill context parallelism with tensor parallelism inside the replica (Part 19), on vLLM's
Model Runner V2 (its V1 runner refuses PCP), with the tiny MLA MoE model (DeepSeek-V2 shaped):

- PCP=2 x TP=2 through FSMWorker (four ranks, one replica) gives HF transformers' greedy tokens
  (FSMWorker corrects vLLM's CPU rotary for MLA, docs/vllm-cpu-rope.md); its four logs name
  each rank's PCP and TP coordinates and replay sound;
- a PCP=2 run given no `run_dir` leaves both ranks' logs in one directory (the name is agreed
  over vLLM's world group, not per process);
- the slower tier (`make test-vllm-slow`): DP=2 x PCP=2 x TP=2, eight ranks, equals
  DP=1 x PCP=1 x TP=2 and replays sound.
The children run MRV2 whichever leg runs this module (their environment says so), hence it runs
once (`runner_independent`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import vllm_dp_cases as c
from vllm_checks import hf_greedy, mrv2_env, records

from runner_fsm.replay.judge import replay
import vllm_harness as h
from runner_fsm.integrations.vllm.offline_dp import Job
from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE, make_model

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def _job(model: str, per_rank, run_dir: Path | None, **parallel) -> Job:
    options = {"collective_timeout_s": 60} if run_dir is None else {"collective_timeout_s": 60, "run_dir": str(run_dir)}
    return Job(h.llm_kwargs(model, block_size=MLA_BLOCK_SIZE, runner_fsm=options, **parallel), per_rank)


def _tokens(result) -> dict:
    merged = {}
    for rank_outputs in result.outputs[0]:
        merged.update(rank_outputs or {})
    return merged


def _failures(result) -> dict:
    """Each failed DP rank's log from its last traceback on (else its end): eight processes
    share two cores here, and a log's tail alone may be a warning printed after the error."""
    out = {}
    for rank, (code, log) in enumerate(zip(result.codes, result.logs)):
        if code != 0:
            start = log.rfind("Traceback (most recent call last)")
            out[rank] = log[start:start + 6000] if start >= 0 else log[-6000:]
    return out


def _run_all(root: Path, cases: dict) -> dict:
    """Each case (dp, job, bind, cwd) in its own thread, all at once."""
    out = {}

    def one(label: str) -> None:
        dp, job, bind, cwd = cases[label]
        out[label] = c.run([job], dp, cwd, timeout_s=1500, env=mrv2_env(VLLM_CPU_OMP_THREADS_BIND=bind))

    threads = [threading.Thread(target=one, args=(label,)) for label in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for label, result in out.items():
        assert all(code == 0 for code in result.codes), (label, result.codes, _failures(result))
        assert "Using V2 Model Runner" in result.logs[0], label
    return out


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pcp-tp")
    model = make_model(root / "deepseek_v2", "deepseek_v2", seed=3)
    cwd = root / "cwd"
    cwd.mkdir()
    cases = {"pcp2-tp2": (1, _job(model, [c.ALL], root / "run-pcp2-tp2", prefill_context_parallel_size=2,
                                  tensor_parallel_size=2), "0|1|0|1", root),
             "pcp2-default-dir": (1, _job(model, [c.ALL], None, prefill_context_parallel_size=2), "0|1", cwd)}
    results = _run_all(root, cases)
    hf = {}
    for name, prompt, new in c.ALL:
        hf.update(hf_greedy(model, {name: list(prompt)}, new))
    return {"model": model, "root": root, "results": results, "hf": hf, "cwd": cwd}


def test_pcp2_tp2_equals_hf_greedy(mla):
    tokens = _tokens(mla["results"]["pcp2-tp2"])
    assert set(tokens) == {"long", "mid", "short"} and tokens == mla["hf"]


def test_pcp2_tp2_logs_every_rank_s_coordinates_and_replays_sound(mla):
    run_dir = mla["root"] / "run-pcp2-tp2"
    for rank in range(4):
        job = records(run_dir, rank)[0]
        pcp, tp = divmod(rank, 2)  # vLLM's order: TP fastest
        assert job["coords"] == {"dp": 0, "pp": 0, "pcp": pcp, "tp": tp}
        assert job["groups"]["tp"] == [2 * pcp, 2 * pcp + 1] and job["groups"]["pcp"] == [tp, 2 + tp]
    report = replay(run_dir)
    assert report.sound and (report.summary.pcp_size, report.summary.tp_size) == (2, 2), report.format()


def test_a_pcp_run_without_run_dir_writes_one_directory(mla):
    """Through vLLM's world group (the rule itself, and the mutation that breaks it, are held by
    tests/test_vllm_rundir.py without vLLM); before this part the two ranks wrote two directories."""
    dirs = sorted(p for p in (mla["cwd"] / "runs").iterdir())
    assert len(dirs) == 1, dirs
    assert sorted(p.name for p in dirs[0].glob("rank-*.jsonl")) == ["rank-0.jsonl", "rank-1.jsonl"]
    assert {records(dirs[0], r)[0]["run_id"] for r in (0, 1)} == {dirs[0].name}
    assert replay(dirs[0]).sound


@pytest.mark.slow
def test_dp2_pcp2_tp2_equals_dp1_pcp1_tp2(tmp_path):
    """Eight ranks (make test-vllm-slow): the idle replica's dummies under PCP and TP."""
    model = make_model(tmp_path / "deepseek_v2", "deepseek_v2", seed=3)
    cases = {"reference": (1, _job(model, [c.ALL], tmp_path / "ref", tensor_parallel_size=2), "0|1", tmp_path),
             "dp2-pcp2-tp2": (2, _job(model, c.PER_RANK, tmp_path / "big", prefill_context_parallel_size=2,
                                      tensor_parallel_size=2), "0|1|0|1|0|1|0|1", tmp_path)}
    results = _run_all(tmp_path, cases)
    assert _tokens(results["dp2-pcp2-tp2"]) == _tokens(results["reference"])
    report = replay(tmp_path / "big")
    assert report.sound and report.summary.ranks == report.summary.expected_ranks == 8, report.format()
    idle = [r for rank in range(4, 8) for r in records(tmp_path / "big", rank)
            if r["event"] == "transition" and r["trigger"] == "idle"]
    assert idle and all(r["outcome"] == "ok" for r in idle)
