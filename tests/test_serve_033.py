"""`python -m runner_fsm.integrations.vllm.serve` under vLLM 0.33's layout, where `cli_env_setup`
moved to `vllm.entrypoints.common.startup`: the stand-in tree (tests/vllm033_standin, lines
cited there) has only 0.33's module, so the import the 0.32 way fails there (ImportError, as
the issue saw). The real `--help` on the installed 0.32 is tests/test_vllm_serve_help.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parent / "vllm033_standin"
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from runner_fsm.integrations.vllm import serve
from vllm.entrypoints.common import startup
serve.main(["some/model", "--data-parallel-size", "2"])
print(json.dumps(startup.CALLS))
"""


def test_serve_runs_vllms_set_up_from_its_033_module():
    out = subprocess.run([sys.executable, "-c", CHILD, str(STANDIN)], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "cli_env_setup", "configure_logging_from_args", "validate", "serve some/model dp=2"]
