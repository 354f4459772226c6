"""A stop request recorded where it starts: vLLM's front process writes it into the run directory.

The process that receives the user's Ctrl-C or SIGTERM is vLLM's front: the API server, a
headless node's launcher, an `LLM` script. With vLLM's default `--shutdown-timeout 0` it kills
its engine cores and their workers a few Python lines later (`vllm.v1.utils.shutdown`): a worker
the kernel has not scheduled in between records nothing of the stop, and its log alone reads as
a death. The front lives on through that shutdown, so the front records the request, in each run
directory its FSMWorkers write, before vLLM's shutdown begins (`process.stop_requests`), with
the evidence replay needs: which of those workers were alive at that moment (same pid, same
start time, not a zombie). A rank alive when the stop was asked for ended in the shutdown that
followed, whatever it managed to record (`rules.stops`).

How the front hears of the stop. vLLM loads this plugin (entry point `runner_fsm_stop_origin`)
in the front before it installs its own signal handling, which then replaces Python handlers set
earlier (the API server's are asyncio's; a headless launcher's raise SystemExit). So:
- the API server logs "[shutdown] API server: shutdown triggered" from its signal callback before
  it stops the engine client, and a headless node's launcher logs "Waiting up to N seconds for
  processes to exit" after its handler's SystemExit, before it shuts its engines down: a handler
  on those two loggers (`logging`'s public API; no vLLM code is patched) records there. Neither
  says which signal: the record says "a stop signal". Their level is held at INFO so a quieter
  `VLLM_LOGGING_LEVEL` does not silence them (vLLM's own handler still prints by its level), and
  both are put back after vLLM configures its logging again (`Front.hook_loggers`).
- any front vLLM leaves Python's handlers to (an `LLM` script): handlers chained in front of the
  process's own (`stop_signals`), which name the signal and then do what was done before.

How it learns of the run. The front opens an abstract unix datagram socket (no name in any file
system; it goes with the process) and names it in the environment its children inherit. Each
FSMWorker, once its run is agreed, sends its run directory, run id, global rank, pid and start
time there (`tell_front`). The kernel attaches the sender's credentials: only a process of the
same user that descends from the front is heard. A thread drains the socket (the kernel queues
ten datagrams at most). A stop before any worker spoke writes nothing: there is no run yet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import secrets
import socket
import struct
import threading
from pathlib import Path

from runner_fsm.process.proc import alive, parent_of, process_start
from runner_fsm.process.stop_requests import record_request
from runner_fsm.process.stop_signals import StopSignals

FRONT_ENV = "RUNNER_FSM_FRONT"  # the socket name of the front this process was started below
# vLLM's words at the start of a stop it was asked for, by logger: what the front was (the same
# in 0.32.0 and 0.33.0: `runner-fsm vllm-check` reads each in the logger's module)
SHUTDOWN_MESSAGES = {
    "vllm.entrypoints.launchers.launcher": ("[shutdown] API server: shutdown triggered", "vLLM's API server"),
    "vllm.entrypoints.cli.serve": ("Waiting up to %d seconds for processes to exit",
                                   "`vllm serve`'s main process (a headless node, or several API servers' launcher)"),
}
_UCRED = struct.Struct("3i")  # pid, uid, gid: SCM_CREDENTIALS
_FRONT: "Front | None" = None


def register() -> None:
    """vLLM's plugin entry point, called in every vLLM process (maybe more than once): in a front,
    and only there, start listening and hearing stops. vLLM starts each of its other processes
    (engine cores, workers, API servers under a launcher, the DP coordinator) with
    `multiprocessing`; a front is a process nobody started so: a script, `vllm serve`, or a
    server a program launched (a front of its own, whatever front its launcher was)."""
    global _FRONT
    if _FRONT is not None or multiprocessing.parent_process() is not None:
        return
    with contextlib.suppress(OSError):  # no abstract sockets here (not Linux): nothing is recorded
        _FRONT = Front.start()


class Front:
    """The front process's side: the workers that spoke, and the requests recorded for them."""

    def __init__(self, sock: socket.socket, name: str):
        self._sock, self.name = sock, name
        self.workers: dict[int, dict] = {}  # pid -> what the worker said
        self._hooks: dict[str, logging.Handler] = {}

    @classmethod
    def start(cls) -> "Front":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"runner-fsm-front-{os.getpid()}-{secrets.token_hex(6)}"
        sock.bind("\0" + name)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        front = cls(sock, name)
        os.environ[FRONT_ENV] = name
        front._hooks = {name: _ShutdownHeard(front, name) for name in SHUTDOWN_MESSAGES}
        front.hook_loggers()
        threading.Thread(target=front._listen, name="runner-fsm-front", daemon=True).start()
        # From the handler only (`early=False`): a watch thread would take the process's wakeup fd,
        # which is the user's program's to set (an `LLM` script's own event loop).
        StopSignals(lambda signal_name: front.record(signal_name, "the process vLLM runs in"), early=False).install()
        return front

    def hook_loggers(self) -> None:
        """Our handlers on vLLM's front loggers, at INFO. vLLM configures its logging again after
        loading plugins (`configure_logging_from_args`: `logging.config.dictConfig`, which empties
        the handlers of a configured logger's children and resets their level), so this runs at
        start-up and again whenever a worker speaks, long after that."""
        for name, handler in self._hooks.items():
            logger = logging.getLogger(name)
            if handler not in logger.handlers:
                logger.addHandler(handler)
            if not logger.isEnabledFor(logging.INFO):
                logger.setLevel(logging.INFO)

    def _listen(self) -> None:
        space = socket.CMSG_SPACE(_UCRED.size)
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, space)
                said = json.loads(data)
                sender = next(_UCRED.unpack(d[:_UCRED.size]) for level, kind, d in ancillary
                              if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
            except (OSError, ValueError, StopIteration):
                continue
            pid, uid, _ = sender
            if uid == os.getuid() and said.get("pid") == pid and _descends(pid, os.getpid()):
                self.workers[pid] = said
                self.hook_loggers()

    def record(self, signal_name: str | None, kind: str) -> None:
        """The request, in every run directory a worker named, with each worker's liveness now.
        Called from a signal handler or a logging handler: must never raise."""
        with contextlib.suppress(Exception):
            runs: dict[tuple[str, str], dict[str, list[int]]] = {}
            for pid, said in list(self.workers.items()):
                entry = runs.setdefault((said["run_dir"], said["run_id"]), {"alive": [], "gone": []})
                entry["alive" if alive(pid, said["start"]) else "gone"].append(int(said["global_rank"]))
            for (run_dir, run_id), ranks in runs.items():
                record_request(run_dir, run_id, signal_name, kind, ranks["alive"], ranks["gone"])


def _descends(pid: int, ancestor: int) -> bool:
    """`pid` is `ancestor` (a worker in the front's own process: vLLM without multiprocessing) or below it."""
    if pid == ancestor:
        return True
    while pid > 1:
        pid = parent_of(pid)
        if pid == ancestor:
            return True
    return False


class _ShutdownHeard(logging.Handler):
    """On one of vLLM's front loggers: its words at the start of a stop it was asked for."""

    def __init__(self, front: Front, logger_name: str):
        super().__init__(logging.INFO)
        self._front = front
        self._words, self._kind = SHUTDOWN_MESSAGES[logger_name]

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == self._words:
            self._front.record(None, self._kind)


def tell_front(run_dir: str, run_id: str, global_rank: int) -> bool:
    """A worker's side: tell the front this process descends from where it writes (False: no front
    named here, or it could not be reached; the worker then records its stops alone, as before)."""
    name = os.environ.get(FRONT_ENV)
    if not name:
        return False
    said = {"run_dir": str(Path(run_dir).resolve()), "run_id": str(run_id), "global_rank": int(global_rank),
            "pid": os.getpid(), "start": process_start(os.getpid())}
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5.0)  # the front's thread drains the queue; a front that is gone refuses at once
        sock.sendto(json.dumps(said).encode(), "\0" + name)
        return True
    return False
