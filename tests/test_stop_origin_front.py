"""vLLM's front process records a stop request where it starts (`integrations.vllm.stop_origin`),
without vLLM: a front process (the plugin's `register()`), worker processes below it that tell
it where they write, and the two ways the front hears a stop (its own signal handler; vLLM's
words on its loggers). Each front runs in a child process: the handlers it installs are its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

FRONT = textwrap.dedent("""
    import logging, logging.config, os, subprocess, sys, time
    from pathlib import Path
    from runner_fsm.integrations.vllm import stop_origin
    stop_origin.register()
    # vLLM configures its logging again after loading its plugins (`configure_logging_from_args`),
    # here as VLLM_LOGGING_LEVEL=WARNING does: the handlers of the `vllm` logger's children go
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                               "loggers": {"vllm": {"level": "WARNING"}}})
    assert not logging.getLogger("vllm.entrypoints.cli.serve").handlers
    run_dir, how = sys.argv[1], sys.argv[2]
    worker = ("import sys, time; from runner_fsm.integrations.vllm import stop_origin;"
              "assert stop_origin.tell_front(sys.argv[1], 'rid', int(sys.argv[2])); time.sleep(float(sys.argv[3]))")
    workers = [subprocess.Popen([sys.executable, "-c", worker, run_dir, str(rank), str(life)])
               for rank, life in ((0, 60), (1, 0))]
    def state(pid):
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    while state(workers[1].pid) != "Z":  # rank 1 ended before the stop: a zombie (not reaped yet), gone
        time.sleep(0.01)
    assert stop_origin.tell_front(run_dir, "rid", 2)  # a worker in the front's own process (no multiprocessing)
    deadline = time.monotonic() + 30
    while len(stop_origin._FRONT.workers) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("ready", os.environ["RUNNER_FSM_FRONT"], flush=True)
    if how == "vllm-words":
        logging.getLogger("vllm.entrypoints.cli.serve").info("Waiting up to %d seconds for processes to exit", 0)
        logging.getLogger("vllm.entrypoints.cli.serve").info("Shutting down.")  # other words: nothing
    else:
        time.sleep(60)  # the test's signal ends it
    workers[0].kill()
""")


def _start(tmp_path: Path, how: str, *, ignore_sigint: bool = False) -> subprocess.Popen:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RUNNER_FSM_FRONT"}
    proc = subprocess.Popen([sys.executable, "-c", FRONT, str(run_dir), how], stdout=subprocess.PIPE, text=True,
                            env=env, preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint
                            else None)
    ready, proc.front_name = proc.stdout.readline().split()
    assert ready == "ready"
    return proc


def _requests(tmp_path: Path, pid: int) -> list[dict]:
    path = tmp_path / "run" / f"stops-{os.uname().nodename}-{pid}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_front_is_recorded_naming_it_and_who_was_alive(tmp_path, sig):
    """Mutations seen to fail it: the liveness taken from the pid alone (a zombie counts as alive),
    the signal handler not installed."""
    proc = _start(tmp_path, "signal")
    proc.send_signal(sig)
    assert proc.wait(timeout=30) != 0  # the front then did what it did before: stopped
    (request,) = _requests(tmp_path, proc.pid)
    assert request["signal"] == sig.name and request["run_id"] == "rid" and request["event"] == "stop_request"
    assert (request["alive"], request["gone"]) == ([0, 2], [1]), request
    assert request["process"] == "the process vLLM runs in" and request["pid"] == proc.pid


def test_vllm_s_words_at_a_requested_shutdown_are_recorded_even_under_a_quieter_log_level(tmp_path):
    """The headless launcher's "Waiting up to N seconds" (logged at INFO, the `vllm` logger at
    WARNING, vLLM's logging configured again after the plugin loaded): one request, no signal
    named; vLLM's other words record nothing. Mutation seen to fail it: `hook_loggers` not run
    again when a worker speaks."""
    proc = _start(tmp_path, "vllm-words")
    assert proc.wait(timeout=30) == 0
    (request,) = _requests(tmp_path, proc.pid)
    assert request["signal"] is None and request["process"].startswith("`vllm serve`'s main process"), request
    assert (request["alive"], request["gone"]) == ([0, 2], [1]), request


def test_an_ignored_sigint_is_no_request(tmp_path):
    """A front whose launcher ignores SIGINT (nohup, a background job) keeps ignoring it."""
    proc = _start(tmp_path, "signal", ignore_sigint=True)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None and _requests(tmp_path, proc.pid) == []
    proc.terminate()
    assert proc.wait(timeout=30) != 0 and [r["signal"] for r in _requests(tmp_path, proc.pid)] == ["SIGTERM"]


def test_a_process_that_does_not_descend_from_the_front_is_not_heard(tmp_path):
    """The front's socket is named in the environment: a process outside its tree that copied the
    name (another job started from the same shell) is refused, and becomes a front itself."""
    proc = _start(tmp_path, "signal")
    try:
        stranger = ("import os, sys; from runner_fsm.integrations.vllm import stop_origin as s;"
                    "told = s.tell_front(sys.argv[1], 'rid', 7); s.register(); print(told, s._FRONT is not None)")
        out = subprocess.run([sys.executable, "-c", stranger, str(tmp_path / "run")], capture_output=True, text=True,
                             env={**os.environ, "RUNNER_FSM_FRONT": proc.front_name}, timeout=60)
        assert out.stdout.split() == ["True", "True"], out.stderr  # sent, and a front of its own
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    (request,) = _requests(tmp_path, proc.pid)
    assert 7 not in request["alive"] + request["gone"], request
