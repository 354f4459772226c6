"""How `engine.launch.spawn` starts ranks: forks of one fork server that has torch imported, each
given the launcher's environment as it is at that job's `spawn`; and `runner-fsm run`'s launcher,
which starts fresh interpreters, never imports torch itself (only its ranks need it).

Mutations seen to fail it: the `spawn` start method (every rank's parent is the launcher); the fork
server without `child_env` (the second job sees the first job's variable, and the removed one);
`engine.api` importing `run_rank` from the worker at its top (torch in the launcher); a named entry
imported after the rendezvous (its module then sees the groups up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.launch import spawn

pytestmark = pytest.mark.multiproc

LAYOUT = ParallelLayout(dp_size=1, pcp_size=2)
NAME = "RUNNER_FSM_TEST_LAUNCH_ENV"
GONE = "RUNNER_FSM_TEST_LAUNCH_GONE"


def _groups_at_import() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


GROUPS_AT_IMPORT = _groups_at_import()  # in a rank that imported this module by name: must be False


def _seen(groups) -> dict:
    return {"value": os.environ.get(NAME), "gone": os.environ.get(GONE), "omp": os.environ.get("OMP_NUM_THREADS"),
            "parent": os.getppid()}


def test_each_job_sees_the_environment_the_launcher_had_at_its_spawn(monkeypatch):
    monkeypatch.setenv(NAME, "first")
    monkeypatch.setenv(GONE, "here")
    first = spawn(_seen, LAYOUT, timeout_s=60)
    monkeypatch.setenv(NAME, "second")
    monkeypatch.delenv(GONE)
    second = spawn(_seen, LAYOUT, timeout_s=60)
    assert [r["value"] for r in first] == ["first", "first"]
    assert [r["gone"] for r in first] == ["here", "here"]
    assert [r["value"] for r in second] == ["second", "second"]
    assert [r["gone"] for r in second] == [None, None]
    assert {r["omp"] for r in first + second} == {"1"}  # the children's own setting, not the launcher's


def test_ranks_of_every_job_are_forks_of_one_server_not_of_the_launcher():
    first = spawn(_seen, LAYOUT, timeout_s=60)
    second = spawn(_seen, LAYOUT, timeout_s=60)
    parents = {r["parent"] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents, parents


def _groups_when_imported(groups) -> bool:
    return GROUPS_AT_IMPORT


@pytest.mark.parametrize("fresh", [False, True])
def test_a_named_entry_is_imported_by_each_rank_before_the_rendezvous(fresh):
    """The embedded engine names its ranks' entry (`engine.api.RUN_RANK`): each rank loads its code
    before joining the groups, so that the ranks leave the rendezvous together (test_sigkill's
    start-up moment, every rank logged and none stepping, is caught then)."""
    ranks = spawn(f"{__name__}:_groups_when_imported", LAYOUT, timeout_s=60, fresh_interpreters=fresh)
    assert ranks == [False, False]


def test_fresh_interpreters_are_the_launchers_own_children():
    """`runner-fsm run`'s start (nothing in TMPDIR while it runs: test_nothing_outside)."""
    ranks = spawn(_seen, LAYOUT, timeout_s=60, fresh_interpreters=True)
    assert {r["parent"] for r in ranks} == {os.getpid()}


def test_runner_fsm_runs_launcher_never_imports_torch(models, tmp_path):
    """A DP=2 run from start to its report (outputs written, ranks' reports read back): torch is
    the ranks' alone, about 1.4 s of CPU the launcher no longer spends before they start."""
    argv = ["run", "--model", models[0], "--dp", "2", "--requests", "3", "--max-new-tokens", "3",
            "--out", str(tmp_path / "run")]
    code = ("import json, sys; from runner_fsm.cli import main; code = main(%r);"
            " print(json.dumps([code, 'torch' in sys.modules]))" % argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, False], done.stdout[-2000:] + done.stderr[-2000:]
    assert len((tmp_path / "run" / "outputs.jsonl").read_text().splitlines()) == 3
