"""An engine-core failure through vLLM is a failure in replay, never a clean stop (Part 28);
a SIGTERM the user sends to the `LLM` script is one.

An offline `LLM` with FSMWorker, vLLM's default process layout (the engine core in a process of
its own, `VLLM_ENABLE_V1_MULTIPROCESSING=1`), a scheduler that raises at its 12th call
(`failing_scheduler`, through vLLM's `scheduler_cls`): the engine core logs its fatal error and
shuts the worker down, which records the shutdown call (or, served, the SIGTERM it is told of).
Before, replay read that as a stop someone asked for: SOUND.

The failure runs under both ways vLLM starts the engine core: forked from the script (vLLM's own
method, an `LLM` script's on CUDA: `vllm` below) and spawned (what vLLM's CPU platform imposes:
`cpu`). A forked engine core inherits vLLM's plugins as loaded and loads none itself unless
`forked_plugins` has vLLM load them again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_harness as h
from vllm_checks import plugin_env, stop_note

TESTS = Path(__file__).resolve().parent

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


@pytest.mark.parametrize("start_method", ["vllm", "cpu"])
def test_an_engine_core_failure_is_named_not_read_as_a_stop(vllm_models, tmp_path, start_method):
    """Replay names a `fault` on the worker's rank: vLLM's engine core failed, with the scheduler's
    RuntimeError, at a step of the run, and the run is UNSOUND; the worker's stop record that
    follows is read as the teardown of a failing job. Mutations: the engine-core plugin without its
    failure handler -> replay SOUND, "stop requested" (seen: the SIGTERM the engine core told of);
    `forked_plugins.arm` doing nothing -> the same, under `vllm` (the forked engine core) only."""
    import json

    from runner_fsm.replay.judge import replay

    run_dir = tmp_path / "run"
    kw = h.llm_kwargs(vllm_models["llama"], run_dir=str(run_dir), scheduler_cls="failing_scheduler.FailingScheduler")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    tests = str(TESTS)
    env = _child_env(tmp_path, start_method)
    child = subprocess.run([sys.executable, str(script), json.dumps(kw)], capture_output=True, text=True, env=env,
                           timeout=600, cwd=tests)
    assert "GENERATE FAILED" in child.stdout, child.stdout[-2000:] + child.stderr[-4000:]
    report = replay(run_dir)
    faults = [v for v in report.verdicts if v.kind == "fault"]
    assert not report.sound and faults, report.format()
    assert "EngineCoreFailure" in faults[0].detail and "the scheduler failed at call 12" in faults[0].detail, \
        report.format()
    assert faults[0].step is not None and faults[0].step >= 5, report.format()  # a step of the run


def _child_env(root: Path, start_method: str | None = None) -> dict:
    """vLLM's default process layout, the tests on the path, this package's vLLM plugins found;
    `start_method`: the tier's (None), or `vllm`/`cpu` (tests/vllm_site/runner_fsm_test_start_method.py)."""
    plugins = plugin_env(root)
    path = [plugins.get("PYTHONPATH"), str(TESTS / "vllm_site"), str(TESTS), os.environ.get("PYTHONPATH")]
    env = {**os.environ, **plugins, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    if start_method is not None:
        env["RUNNER_FSM_TEST_START_METHOD"] = start_method
    return env


LONG_CHILD = """
    import json, sys
    import vllm_harness as h
    from vllm import SamplingParams

    if __name__ == "__main__":
        kw = json.loads(sys.argv[1])
        with h.open_llm(**kw) as llm:
            llm.generate([{"prompt_token_ids": list(range(5, 12))}],
                         SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), use_tqdm=False)
"""


def test_a_sigterm_to_the_llm_script_reads_sound_naming_it(vllm_models, tmp_path):
    """The user's SIGTERM to the script (vLLM's engine core in its own process, which holds the
    worker), mid-generation, with the worker frozen first (it records nothing before vLLM ends
    it): the script recorded the request where it started, naming the worker alive. Mutation seen
    to fail it: `stop_origin.Front.start` not installing its signal handlers (rank 0 then reads
    as a death)."""
    import json
    import signal
    import time

    from runner_fsm.audit import read_records
    from runner_fsm.replay.judge import replay

    run_dir = tmp_path / "run"
    script = tmp_path / "long.py"
    script.write_text(textwrap.dedent(LONG_CHILD))
    kw = h.llm_kwargs(vllm_models["llama"], run_dir=str(run_dir))
    child = subprocess.Popen([sys.executable, str(script), json.dumps(kw)], env=_child_env(tmp_path), cwd=str(TESTS),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = run_dir / "rank-0.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.poll() is None:
            steps = [r["step_id"] for r in read_records(log) if isinstance(r["step_id"], int)] if log.exists() else []
            if steps and max(steps) >= 5:
                break
            time.sleep(0.1)
        worker = next(read_records(log))["pid"]
        os.kill(worker, signal.SIGSTOP)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # the engine core, orphaned and frozen
        output = child.communicate()[0]
    assert child.returncode == -signal.SIGTERM, output[-3000:]
    report = replay(run_dir)
    assert report.sound, report.format() + output[-3000:]
    note = stop_note(report)
    assert note.startswith("stop requested: SIGTERM received by the process vLLM runs in") and \
        "with rank(s) 0 alive then" in note, note
