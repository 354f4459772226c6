"""`scripts/gpu_check.py` in its CPU dry mode: the same checks as on a GPU (static graph
back-end, gloo instead of NCCL), so the script CI cannot run on a GPU still runs somewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def test_gpu_check_dry_mode_passes_every_check():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("DP=1 graph outputs equal eager", "DP=1 header check before every replay",
                 "DP=1 stale buffers refuse a replay", "DP=2 replica 1 replays after a dummy",
                 "DP=2 outputs equal eager (DP=2 and DP=1)", "DP=2 stale buffers refuse a replay"):
        assert any(line.startswith(f"PASS  {name}") for line in lines), (name, proc.stdout)
    assert lines[-1].startswith("13/13 checks passed"), lines[-1]
