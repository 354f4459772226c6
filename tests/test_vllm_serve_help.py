"""`python -m runner_fsm.integrations.vllm.serve --help` on the installed vLLM (0.32): vLLM's own
`vllm serve` parser, reached through the release's `cli_env_setup` (`serve.CLI_ENV_SETUP`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def test_serve_help_is_vllm_serves():
    out = subprocess.run([sys.executable, "-m", "runner_fsm.integrations.vllm.serve", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: vllm serve [model_tag] [options]" in out.stdout and "vllm serve --help=all" in out.stdout, \
        out.stdout[-2000:]
