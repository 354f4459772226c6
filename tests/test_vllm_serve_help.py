"""`python -m runner_fsm.integrations.vllm.serve --help` (and `--help=all`) on the installed vLLM (0.32): vLLM's own
`vllm serve` options, through the release's `cli_env_setup` (`serve.CLI_ENV_SETUP`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def test_serve_help_lists_vllm_serves_options():
    short = subprocess.run([sys.executable, "-m", "runner_fsm.integrations.vllm.serve", "--help"], capture_output=True,
                           text=True, timeout=300)
    assert short.returncode == 0 and "vllm serve --help=all" in short.stdout, short.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "runner_fsm.integrations.vllm.serve", "--help=all"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for option in ("--data-parallel-size", "--headless", "--worker-cls", "--data-parallel-hybrid-lb"):
        assert option in out.stdout, out.stdout[-2000:]
