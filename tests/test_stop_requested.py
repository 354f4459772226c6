"""An embedded DP=2 run stopped on purpose reads SOUND, with a note naming the stop: Ctrl-C (SIGINT
to the whole process group) and SIGTERM to the launcher alone (which hands it to every rank).
Each rank records the signal the moment it arrives (`stop_signals`), then stops as it would
have; the run's own exit status is the signal's.

Mutation seen to fail it: the launcher's `spawn` not forwarding a stop request to its ranks
(`StopSignals(...)` in `engine/launch.py` recording nothing): with SIGTERM to the launcher alone
the ranks are SIGKILLed at its exit, logs unexplained (`unfinished`/`hang`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from runner_fsm.audit import read_records
from runner_fsm.replay.judge import replay

pytestmark = pytest.mark.multiproc

STOPS = {"ctrl-c": signal.SIGINT, "sigterm-to-launcher": signal.SIGTERM}
FROZEN = {"ctrl-c-rank-0-frozen": 0, "ctrl-c-rank-1-frozen": 1}  # SIGSTOPped first: it records nothing


def _step(path) -> int:
    try:
        steps = [r["step_id"] for r in read_records(path)]
    except (OSError, ValueError):
        return -1
    return max((s for s in steps if isinstance(s, int)), default=-1)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("stop")
    out = {}

    def one(name: str) -> None:
        run = root / name
        cmd = [sys.executable, "-m", "runner_fsm.cli", "run", "--model", models[0], "--dp", "2", "--requests", "24",
               "--max-new-tokens", "96", "--out", str(run)]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while _step(run / "rank-1.jsonl") < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if name in FROZEN:
            os.kill(next(read_records(run / f"rank-{FROZEN[name]}.jsonl"))["pid"], signal.SIGSTOP)
        if name == "sigterm-to-launcher":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            time.sleep(0.5)  # the ranks outlive the launcher by a moment
        out[name] = (run, proc.returncode)

    threads = [threading.Thread(target=one, args=(name,)) for name in (*STOPS, *FROZEN)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("name", list(STOPS))
def test_a_stop_on_purpose_reads_sound_naming_it(stopped, name):
    run, code = stopped[name]
    signum = STOPS[name]
    assert code == -signum  # the launcher stopped by the signal, as it would have without us
    # Each rank records the signal when its main thread next runs Python: one blocked in a
    # collective then (its peer stopped first) may be killed before it does, and its peer's
    # record covers its end (`stop_signals`). So: a record somewhere, the signal first in each.
    # The launcher forwards the signal it got: with Ctrl-C each rank hears SIGINT twice (the
    # group's, the launcher's), in whichever order; with SIGTERM to the launcher, SIGTERM.
    got = {rank: [r["signal"] for r in read_records(run / f"rank-{rank}.jsonl") if r["event"] == "stop"]
           for rank in (0, 1)}
    assert any(got.values()), got
    assert all(set(signals) == {signum.name} for signals in got.values() if signals), got
    report = replay(run)
    assert report.sound, report.format()
    (note,) = [n for n in report.summary.notes if n.startswith("stop requested")]
    assert note.startswith(f"stop requested: {signum.name} (rank ") and "rank(s) 0, 1 ended after it" in note


@pytest.mark.parametrize("name", list(FROZEN))
def test_a_rank_that_could_not_record_the_ctrl_c_is_explained_by_the_launcher_s_record(stopped, name):
    """The launcher writes the request into the run directory before it hands it on, naming the
    ranks alive then (`process.stop_requests`): a rank the kernel never ran between the Ctrl-C and
    its end (here: stopped) recorded nothing, and its end is the stop's all the same. Mutation
    seen to fail it: `spawn` not calling `on_stop` (the frozen rank reads as a death)."""
    run, code = stopped[name]
    frozen = FROZEN[name]
    assert code == -signal.SIGINT
    assert not [r for r in read_records(run / f"rank-{frozen}.jsonl") if r["event"] == "stop"]
    report = replay(run)
    assert report.sound, report.format()
    note = next(n for n in report.summary.notes if n.startswith("stop requested"))
    assert "SIGINT received by the embedded launcher (runner-fsm run)" in note and \
        "with rank(s) 0, 1 alive then" in note, note
