"""An engine-core failure through vLLM is a failure in replay, never a clean stop (Part 28).

An offline `LLM` with FSMWorker, vLLM's default process layout (the engine core in a process of
its own, `VLLM_ENABLE_V1_MULTIPROCESSING=1`), a scheduler that raises at its 12th call
(`failing_scheduler`, through vLLM's `scheduler_cls`): the engine core logs its fatal error and
shuts the worker down, which records the shutdown call (or, served, the SIGTERM it is told of).
Before, replay read that as a stop someone asked for: SOUND.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_harness as h

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]  # the engine core fails, not the runner: once, in the V1 leg

CHILD = """
    import json, sys
    import vllm_harness as h
    from vllm import SamplingParams

    if __name__ == "__main__":
        kw = json.loads(sys.argv[1])
        with h.open_llm(**kw) as llm:
            try:
                llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 11, 19)],
                             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            except Exception as error:  # vLLM's EngineDeadError: what a user's script sees
                print("GENERATE FAILED", type(error).__name__, flush=True)
"""


def test_an_engine_core_failure_is_named_not_read_as_a_stop(vllm_models, tmp_path):
    """Replay names a `fault` on the worker's rank: vLLM's engine core failed, with the scheduler's
    RuntimeError, at a step of the run, and the run is UNSOUND; the worker's stop record that
    follows is read as the teardown of a failing job. Mutation: the engine-core plugin without its
    failure handler -> replay SOUND, "stop requested" (seen: the SIGTERM the engine core told of)."""
    import json

    from runner_fsm.replay.judge import replay

    run_dir = tmp_path / "run"
    kw = h.llm_kwargs(vllm_models["llama"], run_dir=str(run_dir), scheduler_cls="failing_scheduler.FailingScheduler")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH", "")]))}
    child = subprocess.run([sys.executable, str(script), json.dumps(kw)], capture_output=True, text=True, env=env,
                           timeout=600, cwd=tests)
    assert "GENERATE FAILED" in child.stdout, child.stdout[-2000:] + child.stderr[-4000:]
    report = replay(run_dir)
    faults = [v for v in report.verdicts if v.kind == "fault"]
    assert not report.sound and faults, report.format()
    assert "EngineCoreFailure" in faults[0].detail and "the scheduler failed at call 12" in faults[0].detail, \
        report.format()
    assert faults[0].step is not None and faults[0].step >= 5, report.format()  # a step of the run
