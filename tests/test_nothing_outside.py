"""Nothing outside the run directory (Part 28): a job SIGKILLed whole, at any moment, leaves no
entry in TMPDIR or /dev/shm. vLLM SIGKILLs its engine cores and workers at shutdown, and a
crashed job is killed the same way: whatever the job made outside its run directory would stay.

An embedded run (`runner-fsm run`, DP=2 x PCP=2 with the consensus check, so each replica's
ranks set up a shared-memory exchange) is killed at five moments (`outside_driver`: start-up;
held inside the exchange's set-up, its segment mapped; mid-run; inside its shutdown; after a
stop request's record), each with TMPDIR an empty directory, in a mount namespace of its own
whose /dev/shm is a fresh tmpfs (`unshare`: other jobs on this host come and go in the real one),
listed before and after. Mutation seen to fail it: `shm_exchange` as on main (a file under
/dev/shm, unlinked once every rank mapped it): the kill inside the set-up leaves it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

TESTS = Path(__file__).resolve().parent
MOMENTS = ("start-up", "segment", "mid-run", "shutdown", "after-stop")


def killed_at(moment: str, root: Path, cmd: list[str], run_dir: Path, ranks: int, env: dict,
              timeout_s: float = 240) -> dict:
    """`outside_driver` in a user and mount namespace with /dev/shm a fresh tmpfs (fails, never
    skips, where `unshare` cannot make one)."""
    tmpdir = root / f"tmp-{moment}"
    tmpdir.mkdir()
    spec = {"cmd": cmd, "env": env, "run_dir": str(run_dir), "ranks": ranks, "moment": moment,
            "tmpdir": str(tmpdir), "mark": str(root / f"held-{moment}"), "timeout_s": timeout_s}
    inner = f'mount -t tmpfs tmpfs /dev/shm && exec "$0" {TESTS / "outside_driver.py"} "$1"'
    done = subprocess.run(["unshare", "--user", "--map-current-user", "--mount", "sh", "-c", inner,
                           sys.executable, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout_s + 60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def killed_at_each(moments, root: Path, job, timeout_s: float = 240, at_once: int = 5) -> dict:
    """`killed_at` for every moment, `at_once` jobs at a time (threads; the jobs are processes):
    `job(run_dir, moment)` -> (cmd, ranks, env)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(moment: str) -> dict:
        where = root / moment
        where.mkdir()
        cmd, ranks, env = job(where / "run", moment)
        return killed_at(moment, where, cmd, where / "run", ranks, env, timeout_s)

    with ThreadPoolExecutor(at_once) as pool:
        results = dict(zip(moments, pool.map(one, moments)))
    (root / "results.json").write_text(json.dumps(results, indent=1))  # to read a failure in full
    return results


@pytest.fixture(scope="module")
def embedded_killed(models, tmp_path_factory):
    def job(run: Path, moment: str):
        # Killed mid-run or stopped at step 3, the job must still be running when the driver looks:
        # at 16 new tokens (19 steps) a run on a loaded box once ended before the driver, polling its
        # logs, sent the stop (`after-stop` never reached). The other moments come before the run's
        # steps or at its end, so they need no more.
        tokens = 96 if moment in ("mid-run", "after-stop") else 16
        cmd = [sys.executable, "-m", "runner_fsm.cli", "run", "--model", models[0], "--dp", "2", "--pcp", "2",
               "--consensus", "--requests", "4", "--max-new-tokens", str(tokens), "--out", str(run)]
        return cmd, 4, {"PYTHONPATH": f"{TESTS / 'segment_site'}:{Path.cwd()}"}
    return killed_at_each(MOMENTS, tmp_path_factory.mktemp("outside"), job)


@pytest.mark.parametrize("moment", MOMENTS)
def test_an_embedded_run_killed_whole_leaves_nothing_outside_its_run_dir(embedded_killed, moment):
    out = embedded_killed[moment]
    assert out["reached"], out  # killed at the moment named, not at some other end
    assert out["new"] == {"tmpdir": [], "shm": []}, out
