"""A stop request goes on record the moment it arrives (`stop_signals`, `AuditLog.stop`), and the
process then stops exactly as it would have: the previous handler runs, the default action is
taken, and ours goes away at `restore()`.

Each case runs in a child process: signals are sent to it, and a handler that hangs (waiting
for a lock its own thread holds) shows as a timeout, not a stuck test run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from runner_fsm.audit import read_records


def _child(code: str, tmp_path, timeout: float = 60) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout)


PRELUDE = """
    import os, signal, sys
    from pathlib import Path
    from runner_fsm.audit import AuditLog
    from runner_fsm.stop_signals import StopSignals
    out = Path(sys.argv[1])
    log = AuditLog(out / "run", "r", 0, 0, 0)
    stops = StopSignals(lambda name: log.stop(7, "signal", name))
"""


def test_the_previous_python_handler_runs_after_the_record_and_comes_back(tmp_path):
    """vLLM's worker handler (raise SystemExit) stands in front: it still runs, after the record.
    Mutation seen to fail this: `_handle` not calling `hand_on`."""
    out = _child(PRELUDE + """
    calls = []
    def vllms(signum, frame):
        calls.append(log.next_seq)  # the record is written before the previous handler runs
    signal.signal(signal.SIGTERM, vllms)
    assert stops.install()
    os.kill(os.getpid(), signal.SIGTERM)
    stops.restore()
    assert signal.getsignal(signal.SIGTERM) is vllms
    print(calls)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1]"
    (record,) = read_records(tmp_path / "run" / "rank-0.jsonl")
    assert (record["event"], record["step_id"], record["source"], record["signal"]) == ("stop", 7, "signal", "SIGTERM")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_default_action_is_taken_after_the_record(tmp_path, signum):
    """SIGTERM's default (the process dies by it) and Python's SIGINT (KeyboardInterrupt, after
    which the interpreter dies by SIGINT) happen as without us. Mutation seen to fail this:
    `hand_on` returning without re-raising SIG_DFL."""
    out = _child(PRELUDE + f"""
    stops.install()
    os.kill(os.getpid(), {int(signum)})
    import time
    time.sleep(5)
    print("still alive")
    """, tmp_path)
    assert out.returncode == -signum and "still alive" not in out.stdout, (out.returncode, out.stderr)
    assert ("KeyboardInterrupt" in out.stderr) == (signum == signal.SIGINT)
    (record,) = read_records(tmp_path / "run" / "rank-0.jsonl")  # on disk though the process was killed
    assert record["signal"] == signal.Signals(signum).name


def test_a_signal_during_a_write_of_the_same_thread_is_recorded_after_it(tmp_path):
    """The handler runs between two bytecodes, maybe while its own thread holds the log's lock:
    the record waits for that write, then follows it, seq gapless. Mutation seen to fail this
    (by hanging, the child's timeout): `write_in_handler` writing through `_emit` (the lock)."""
    out = _child(PRELUDE + """
    with log._lock:  # as if the signal came mid-write: what the handler calls, then
        log.stop(3, "signal", "SIGINT")
        assert log.next_seq == 0  # not written yet: the lock is taken
    log.fault(3, "RuntimeError", "the write that held the lock")
    log.close()
    """, tmp_path, timeout=20)
    assert out.returncode == 0, out.stderr
    records = list(read_records(tmp_path / "run" / "rank-0.jsonl"))
    assert [(r["seq"], r["event"]) for r in records] == [(0, "fault"), (1, "stop")]


def test_a_signal_during_another_thread_s_write_waits_for_it(tmp_path):
    """Another thread holds the lock (a collective's record from its worker thread): the record
    is on disk when the handler returns, for the process may die right after it (the default
    action of SIGTERM). Mutation seen to fail this: `write_in_handler` never waiting (wait_s 0)."""
    out = _child(PRELUDE + """
    import threading, time
    taken = threading.Event()
    def writer():
        with log._lock:
            log._holder = threading.get_ident()
            taken.set()
            time.sleep(0.05)
            log._holder = None
    thread = threading.Thread(target=writer)
    thread.start()
    taken.wait()
    log.stop(3, "signal", "SIGTERM")
    print(log.next_seq)
    thread.join()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_not_installed_outside_the_main_thread(tmp_path):
    out = _child(PRELUDE + """
    import threading
    result = []
    thread = threading.Thread(target=lambda: result.append(stops.install()))
    thread.start(); thread.join()
    print(result)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[False]"


def test_a_stop_on_a_closed_log_is_dropped_quietly(tmp_path):
    """After close (a rank that shut down), a late signal must not fail vLLM's own handling."""
    out = _child(PRELUDE + """
    log.close()
    stops.install()
    def previous_ran(signum, frame):
        print("handed on")
    stops._previous[signal.SIGTERM] = previous_ran
    os.kill(os.getpid(), signal.SIGTERM)
    """, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "handed on", out.stderr
