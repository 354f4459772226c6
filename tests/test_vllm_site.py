"""The vLLM tiers' test set-up (tests/vllm_site), in children with and without each part's
environment.

- The MRV2 leg's stand-in: vLLM's check finds a working Triton and the interpreter runs without
  its overflow sanitizer, whose asserts it drops anyway with debug off (the sanitizer's work was a
  third of an MRV2 step's CPU); without the leg's environment the stand-in does nothing. Mutation
  seen to fail it: the stand-in leaving the interpreter builder's options as they are.
- The start method: under `RUNNER_FSM_TEST_START_METHOD=vllm` the first engine a process
  configures on vLLM's CPU platform starts its processes with `fork`, vLLM's own default, or with
  the `spawn` vLLM's CLI set before (served); a later one, and any under `cpu`, with the `spawn`
  the CPU platform imposes. On a vLLM other than 0.32.0 the wrapper is not installed, and this
  fails. Mutations seen to fail it: the wrapper putting nothing back (every case `spawn`); the
  wrapper acting for every engine, not the first alone (the second `fork`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_checks import mrv2_env

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

PROBE = """
import json, triton
import triton.runtime.interpreter as ti
from vllm.triton_utils.importing import HAS_TRITON
options = ti.interpreter_builder.options
print(json.dumps([triton.__version__, HAS_TRITON, options.sanitize_overflow, options.debug]))
"""


def _probe(env: dict) -> list:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_leg_gets_a_working_triton_and_an_interpreter_without_the_sanitizer():
    plain = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET")}
    assert _probe({**plain, **mrv2_env()}) == ["3.9.0", True, False, False]


def test_without_the_legs_environment_it_does_nothing():
    plain = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET")}
    assert _probe({**plain, "PYTHONPATH": mrv2_env()["PYTHONPATH"]}) == ["3.9.0", False, True, False]


START_PROBE = """
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.system_utils import get_mp_context
seen = [getattr(CpuPlatform.check_and_update_config, "runner_fsm_test", False)]
for _ in range(2):  # the process's first engine, then its second
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    if sys.argv[2] != "unset":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = sys.argv[2]
    EngineArgs(model=sys.argv[1], dtype="float32", enforce_eager=True).create_engine_config()
    seen.append(get_mp_context().get_start_method())
print(json.dumps(seen))
"""


@pytest.mark.parametrize("mode, before, methods", [
    ("vllm", "unset", ["fork", "spawn"]),  # vLLM's default for an `LLM` script's first engine
    ("vllm", "spawn", ["spawn", "spawn"]),  # vLLM's CLI asked for it first (served)
    ("cpu", "unset", ["spawn", "spawn"]),  # the CPU platform's
])
def test_vllms_own_start_method_for_a_processs_first_engine_where_the_tier_asks(vllm_models, mode, before, methods):
    """The wrapper is in place; under `vllm` the process's first engine gets vLLM's own method and
    its second the CPU platform's `spawn` (OpenMP's threads do not survive a fork of a process that
    ran a model); under `cpu` both spawn."""
    env = {**os.environ, "PYTHONPATH": mrv2_env()["PYTHONPATH"], "RUNNER_FSM_TEST_START_METHOD": mode}
    done = subprocess.run([sys.executable, "-c", START_PROBE, vllm_models["llama"], before], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, *methods]
