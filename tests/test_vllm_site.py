"""The MRV2 leg's stand-in (tests/mrv2_site): in a child with the leg's environment, vLLM's check
finds a working Triton and the interpreter runs without its overflow sanitizer, whose asserts it
drops anyway with debug off (the sanitizer's work was a third of an MRV2 step's CPU); without the
leg's environment the stand-in does nothing. Mutation seen to fail it: the stand-in leaving the
interpreter builder's options as they are (the sanitizer on)."""

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
