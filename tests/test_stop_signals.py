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
import time
from pathlib import Path

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
    from runner_fsm.process.stop_signals import StopSignals
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


def test_a_handler_that_raises_mid_write_leaves_its_record_after_it(tmp_path):
    """The handler lands inside a write of its own thread (its record waits behind it), then
    raises (Python's KeyboardInterrupt, vLLM's SystemExit): the record is written as the
    exception leaves the write, for nothing else may write after it. Mutation seen to fail this:
    `_write_all` writing what waits only after a write that returned."""
    out = _child(PRELUDE + """
    real = log._render_lines
    def interrupted(*args):
        log._render_lines = real  # once: the record's own write renders as usual
        real(*args)
        log.stop(3, "signal", "SIGINT")  # the handler, between two bytecodes of this write
        raise KeyboardInterrupt
    log._render_lines = interrupted
    try:
        log.fault(3, "RuntimeError", "the write the signal interrupted")
    except KeyboardInterrupt:
        pass
    print(log.next_seq)
    """, tmp_path, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    records = list(read_records(tmp_path / "run" / "rank-0.jsonl"))
    assert [(r["seq"], r["event"], r["signal"]) for r in records] == [(0, "stop", "SIGINT")]


def test_sigterm_to_a_loop_writing_records_dies_by_it_after_the_record(tmp_path):
    """`stops_on_loop`: SIGTERM to a process whose loop writes records all the time (most
    arrivals land mid-write) still leaves its `stop` record, then the process dies by SIGTERM.
    Eight processes, signalled while they write. Mutation seen to fail this: `stops_on_loop`
    chaining to SIG_DFL in the handler (`StopSignals` alone), which lost most records."""
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
    import sys
    import anyio
    from runner_fsm.audit import AuditLog
    from runner_fsm.process.stop_signals import stops_on_loop

    async def main(log):
        async with stops_on_loop(lambda name: log.stop(9, "signal", name)):
            for step in range(10**9):
                log.collective(step, "dp", "all_reduce", 0, [[4]], step, "enqueue")
                if step == 200:
                    print("writing", flush=True)
                await anyio.sleep(0)

    anyio.run(main, AuditLog(sys.argv[1], "r", 0, 0, 0))
    """))
    runs = [tmp_path / f"run{i}" for i in range(8)]
    children = [subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.PIPE, text=True)
                for run in runs]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "writing"
        time.sleep(0.05)
        for child in children:
            child.send_signal(signal.SIGTERM)
        codes = [child.wait(timeout=30) for child in children]
    finally:
        for child in children:
            child.kill() if child.poll() is None else None
    assert codes == [-signal.SIGTERM] * len(children)
    for run in runs:
        stops = [r for r in read_records(run / "rank-0.jsonl") if r["event"] == "stop"]
        assert [(r["step_id"], r["signal"]) for r in stops] == [(9, "SIGTERM")], run


def test_stops_on_loop_puts_the_previous_handlers_back_after_a_failed_body(tmp_path):
    """A body that raises (a rank's fault) leaves the handlers as it found them, not the
    receiver's defaults. Mutation seen to fail this: the handlers put back only after a body
    that returned."""
    out = _child(PRELUDE + """
    import anyio
    from runner_fsm.process.stop_signals import stops_on_loop
    def mine(signum, frame):
        pass
    signal.signal(signal.SIGINT, mine)
    async def body():
        async with stops_on_loop(lambda name: None):
            raise RuntimeError("the rank failed")
    try:
        anyio.run(body)
    except BaseException:
        pass
    print(signal.getsignal(signal.SIGINT) is mine, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True"


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


def test_stops_on_loop_outside_the_main_thread_runs_its_body_with_no_handler(tmp_path):
    """An engine run from a library's worker thread: its loop sets no handler (Python refuses
    to there), and runs as before. Mutation seen to fail this: no main-thread check."""
    out = _child(PRELUDE + """
    import threading, anyio
    from runner_fsm.process.stop_signals import stops_on_loop
    result = []
    async def body():
        async with stops_on_loop(lambda name: None):
            result.append(signal.getsignal(signal.SIGTERM))
    thread = threading.Thread(target=lambda: anyio.run(body))
    thread.start(); thread.join()
    print(result == [signal.SIG_DFL])
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


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


def test_a_main_thread_blocked_in_c_still_records_the_stop_before_the_kill(tmp_path):
    """The rank's main thread cannot run a Python handler (it waits in C, as in a gloo
    collective: here it blocks SIGTERM, so the kernel hands the signal to another thread and
    the main thread's wait goes on). The watch thread records the stop at once; then the
    process is SIGKILLed, as vLLM does right after its SIGTERM. Mutation seen to fail this:
    `StopSignals(early=False)` as the default (no record: the handler never ran)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(PRELUDE + """
    import threading, time
    assert stops.install() and stops.early
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread that takes it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("ready", flush=True)
    time.sleep(60)  # blocked in C: the Python handler cannot run before the kill
    """))
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        _wait_until_asleep_in_c(child.pid)
        log = tmp_path / "run" / "rank-0.jsonl"
        child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _records(log) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.01)
        assert child.poll() is None  # still blocked: only the watch could have written
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert [(r["event"], r["step_id"], r["signal"]) for r in _records(log)] == [("stop", 7, "SIGTERM")]


def _wait_until_asleep_in_c(pid: int, timeout_s: float = 30.0) -> None:
    """Until the main thread sleeps in the kernel (its `time.sleep`): sent between its "ready" and
    that sleep (a loaded machine), the signal finds it running bytecode, its handler runs at once,
    and the default action ends the process (SIGTERM, not the test's SIGKILL: seen under load)."""
    deadline = time.monotonic() + timeout_s
    wchan = Path(f"/proc/{pid}/task/{pid}/wchan")
    while "nanosleep" not in wchan.read_text():
        assert time.monotonic() < deadline, f"the child's main thread never slept: {wchan.read_text()!r}"
        time.sleep(0.01)


def test_each_arrival_is_recorded_once_though_both_the_watch_and_the_handler_hear_it(tmp_path):
    """Three SIGTERMs with a free main thread, whose handler runs at once each time: three
    records, not six (`settle`), and the previous handler after each. Mutation seen to fail
    this: `SignalWatch.settle` always returning False (the watch records each arrival again)."""
    out = _child(PRELUDE + """
    import time
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(log.next_seq))
    assert stops.install() and stops.early
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    stops.restore()
    print(calls)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 2, 3]"
    assert [r["signal"] for r in read_records(tmp_path / "run" / "rank-0.jsonl")] == ["SIGTERM"] * 3


def test_a_wakeup_fd_someone_set_is_left_to_them(tmp_path):
    """An asyncio loop's wakeup fd: no watch, the handler records, and theirs stays set.
    Mutation seen to fail this: `_start` taking any wakeup fd it replaced as free
    (`if previous is None:` for `if previous != -1:`)."""
    out = _child(PRELUDE + """
    import socket
    theirs, _ = socket.socketpair()
    theirs.setblocking(False)
    signal.set_wakeup_fd(theirs.fileno())
    assert stops.install() and not stops.early
    os.kill(os.getpid(), signal.SIGINT)
    """, tmp_path)
    assert "KeyboardInterrupt" in out.stderr  # handed on to Python's own handler
    (record,) = read_records(tmp_path / "run" / "rank-0.jsonl")
    assert record["signal"] == "SIGINT"
    out = _child(PRELUDE + """
    import socket
    theirs, _ = socket.socketpair()
    theirs.setblocking(False)
    signal.set_wakeup_fd(theirs.fileno())
    stops.install()
    stops.restore()
    print(signal.set_wakeup_fd(-1) == theirs.fileno())
    """, (tmp_path / "again").mkdir() or tmp_path / "again")
    assert out.stdout.strip() == "True", out.stderr


def test_a_forked_child_does_not_feed_its_parents_watch(tmp_path):
    """After fork the pipe is the parent's: the child forgets it, so a signal to the child is
    not recorded as the parent's, and the child can start a watch of its own. Mutation seen
    to fail this: no `os.register_at_fork` (the child keeps the parent's pipe as its wakeup fd)."""
    out = _child(PRELUDE + """
    import time
    from runner_fsm.process.signal_watch import WATCH
    assert stops.install() and WATCH.active
    pid = os.fork()
    if pid == 0:
        ok = not WATCH.active and signal.set_wakeup_fd(-1) == -1
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    time.sleep(0.1)
    print(os.waitstatus_to_exitcode(status), log.next_seq)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 0"


def _records(path) -> list[dict]:
    try:
        return list(read_records(path))
    except (OSError, ValueError):
        return []


def test_a_sigint_the_launcher_ignored_stays_ignored_and_is_no_stop(tmp_path):
    """Started with SIGINT ignored (nohup, a background job of a non-interactive shell), a process
    keeps ignoring it, as Python does (no KeyboardInterrupt), and records no stop for it: nothing
    stopped. SIGTERM, not ignored, is still recorded and still kills. Mutation: `install` chaining
    in front of SIG_IGN -> a SIGINT stop record in a process that went on."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(PRELUDE + """
    print(stops.install(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    import time
    time.sleep(0.2)
    print("still alive", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    """))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.returncode == -signal.SIGTERM and out.stdout.split("\n")[:2] == ["True True", "still alive"], \
        (out.returncode, out.stdout, out.stderr)
    assert [r["signal"] for r in read_records(tmp_path / "run" / "rank-0.jsonl")] == ["SIGTERM"]


def test_the_watch_stopped_while_it_waits_for_a_handler_reads_no_more(tmp_path):
    """The last subscriber leaves (the main thread stops the watch) while the watch thread waits
    out a handler's grace: the thread went on to read the pipe the stop had just forgotten and died
    (TypeError, 11 of 20 rounds before the fix). Twenty rounds, no error in any thread."""
    out = _child("""
        import os, signal, sys, threading, time
        from runner_fsm.process.signal_watch import SignalWatch
        errors = []
        threading.excepthook = lambda args: errors.append(repr(args.exc_value))
        signal.signal(signal.SIGUSR1, lambda *a: None)  # a handler that never settles: the watch waits
        for _ in range(20):
            watch = SignalWatch()
            subscription = watch.subscribe(signal.SIGUSR1, lambda signum: None)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.005)  # inside the watch's grace for a handler
            watch.unsubscribe(subscription)  # the last subscriber: the watch stops
            time.sleep(0.05)
        print("errors", len(errors), errors[:1])
    """, tmp_path)
    assert out.stdout.split()[:2] == ["errors", "0"], out.stdout + out.stderr
