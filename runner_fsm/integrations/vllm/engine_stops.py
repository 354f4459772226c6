"""vLLM's engine core hears of a stop before its workers do, and tells them: a vLLM plugin.

`vllm serve` stops (SIGTERM to the server; Ctrl-C with the default `--shutdown-timeout 0`) by
sending SIGTERM to each engine-core process and, at once, SIGKILL to it and to its worker
processes, workers first (`vllm.v1.utils.shutdown`, `kill_process_tree`): with SIGTERM to the
server alone, no signal ever reaches a worker, so FSMWorker could not record the stop itself.
vLLM loads its general plugins (entry point group `vllm.general_plugins`, declared in this
package's metadata) in every process it starts, its engine cores included (first thing in
`EngineCore.__init__`, after vLLM's own SIGINT/SIGTERM handlers are in place; in an engine core
vLLM forks too, where `forked_plugins` has vLLM load them again). There
`register()` chains a handler in front of vLLM's that hands NOTICE to every FSMWorker of this
engine core, which records the stop in its own log (`WorkerNotice`), then runs vLLM's handler.

An engine core that fails (an error in its busy loop: vLLM logs "EngineCore encountered a fatal
error." with the exception, then tears its workers down) tells its workers the same way, before
the teardown, and each records the failure as a `fault` (`ENGINE_FAILURE`): the SIGTERMs that
follow are vLLM's shutdown of a failing job, which replay reads as no stop request. The failure is
heard through a handler on vLLM's engine-core logger (`logging`'s public API; no vLLM code is
patched): a vLLM that words the message otherwise is told apart by no failure record, as before.

The registry where the two meet is in no file system (`EngineRegistry`): vLLM SIGKILLs engine
cores and workers, so nothing they made could be cleaned up after them, and the engine core does
not know the run directory when vLLM calls `register()`. It is an anonymous file in memory
(Linux `memfd_create`), gone with the last process holding it. `register()` publishes where its
workers open it (REGISTRY_ENV: the engine core's pid, start time and descriptor, read through
`/proc/<pid>/fd/`); each FSMWorker started from there appends a line naming itself (pid and
start time), the engine core appends the signal it received or what it failed with, then sends
NOTICE to each worker still running as the process that registered (a SIGKILLed worker's line
stays; its pid may be another process's later). In any other process, an engine core whose
workers are not FSMWorkers, or a system without `memfd_create` (the engine core then tells
nobody; a worker still records its own signals), nothing is told to anyone: NOTICE is a signal
processes ignore unless they asked for it, and it goes only to registered processes. vLLM itself
is not changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import signal
from typing import Callable

from runner_fsm.integrations.vllm import forked_plugins
from runner_fsm.process.proc import process_start
from runner_fsm.process.signal_watch import WATCH
from runner_fsm.process.stop_signals import StopSignals

NOTICE = signal.SIGWINCH  # ignored by default: a process that did not ask for it is untouched
REGISTRY_ENV = "RUNNER_FSM_ENGINE_REGISTRY"  # "<engine core pid>:<its start time>:<descriptor>"
ENGINE_FAILURE = "EngineCoreFailure"  # the `fault` record's error: vLLM's engine core failed
_ENGINE_LOGGER, _FATAL = "vllm.v1.engine.core", "EngineCore encountered a fatal error"  # vLLM's words


def register() -> None:
    """vLLM's plugin entry point, called in every vLLM process (maybe more than once)."""
    forked_plugins.arm()  # an engine core vLLM forks from here calls this again (forked_plugins)
    if not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    published = os.environ.get(REGISTRY_ENV, "")
    if published.split(":")[0] == str(os.getpid()) or not hasattr(os, "memfd_create"):
        return  # registered already (an inherited one is another engine core's); or no memfd here
    registry = EngineRegistry.create()
    os.environ[REGISTRY_ENV] = registry.address  # inherited by the worker processes vLLM starts from here
    StopSignals(lambda name: tell_workers(registry, name)).install()
    logging.getLogger(_ENGINE_LOGGER).addHandler(_FailureHandler(registry))


class EngineRegistry:
    """One engine core's registry: lines appended by it and its workers to an anonymous file.

    `engine <pid> <start>` (first: whose it is), `worker <pid> <start>`, `left <pid>`, `signal
    <name>`, `failure <json string>`. Appends (O_APPEND, one write each) never interleave; a
    reader takes whole lines only."""

    def __init__(self, fd: int, address: str):
        self.fd, self.address = fd, address

    @classmethod
    def create(cls) -> "EngineRegistry":
        pid = os.getpid()
        fd = os.memfd_create("runner-fsm-engine-stops")  # close-on-exec: workers open it by /proc
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        registry = cls(fd, f"{pid}:{process_start(pid)}:{fd}")
        registry.append(f"engine {pid} {process_start(pid)}")
        return registry

    @classmethod
    def join(cls, address: str | None) -> "EngineRegistry | None":
        """The registry published at `address`, while the engine core that made it is there
        (None: none published, its maker gone, or its pid another process's now)."""
        pid, start, fd = ((address or "").split(":") + ["", "", ""])[:3]
        if not (pid.isdigit() and fd.isdigit()) or process_start(int(pid)) != start:
            return None
        try:
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except OSError:
            return None
        registry = cls(opened, address)
        if registry.lines()[:1] != [f"engine {pid} {start}"]:  # another file behind that number
            registry.close()
            return None
        return registry

    def append(self, line: str) -> None:
        os.write(self.fd, (line.replace("\n", " ") + "\n").encode())

    def lines(self) -> list[str]:
        data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        return data.decode(errors="replace").split("\n")[:-1]  # the last, unfinished, not yet

    def last(self, kind: str) -> str | None:
        """The newest `kind` line's value."""
        for line in reversed(self.lines()):
            if line.startswith(kind + " "):
                return line[len(kind) + 1:]
        return None

    def workers(self) -> list[tuple[int, str]]:
        """(pid, start) of each worker registered and not left."""
        found: dict[int, str] = {}
        for line in self.lines():
            kind, _, rest = line.partition(" ")
            pid, _, start = rest.partition(" ")
            if kind == "worker" and pid.isdigit():
                found[int(pid)] = start
            elif kind == "left" and pid.isdigit():
                found.pop(int(pid), None)
        return list(found.items())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _FailureHandler(logging.Handler):
    """On vLLM's engine-core logger: its fatal error, told to the workers before the teardown."""

    def __init__(self, registry: EngineRegistry):
        super().__init__(logging.ERROR)
        self._registry = registry

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is None or not str(record.msg).startswith(_FATAL):
            return
        error = record.exc_info[1]
        with contextlib.suppress(Exception):  # telling must never change how vLLM fails
            tell_workers(self._registry, failure=f"{type(error).__name__}: {error}")


def tell_workers(registry: EngineRegistry, signal_name: str | None = None, failure: str | None = None) -> None:
    """Hand NOTICE to each FSMWorker registered in `registry` (from a signal handler), with the
    signal the engine core received, or what it failed with."""
    if failure is not None:
        registry.append(f"failure {json.dumps(failure)}")
    else:
        registry.append(f"signal {signal_name}")
    for pid, start in registry.workers():
        if pid != os.getpid() and process_start(pid) == start:  # a worker inside heard the signal;
            with contextlib.suppress(OSError):  # a pid now another process's is not told
                os.kill(pid, NOTICE)


class WorkerNotice:
    """A worker's side: registered with its engine core, NOTICE recorded as the engine's stop."""

    def __init__(self, record: Callable[[str], None], failed: Callable[[str], None] | None = None):
        """`record(signal_name)`: the engine core's stop; `failed(message)`: its failure."""
        self._record, self._failed = record, failed
        self._failure_told = False  # once: the engine core's SIGTERM after its failure is a signal again
        self._registry: EngineRegistry | None = None
        self._previous = None
        self._subscription = None  # heard from the watch thread too (`signal_watch`)

    def install(self) -> bool:
        """Register this process with its engine core (False: none published a registry here)."""
        registry = EngineRegistry.join(os.environ.get(REGISTRY_ENV))
        if registry is None:
            return False
        try:
            self._previous = signal.signal(NOTICE, self._handle)
        except ValueError:  # not the main thread: Python sets no handler here
            registry.close()
            return False
        self._registry = registry
        self._subscription = WATCH.subscribe(NOTICE, lambda _signum: self._told())
        registry.append(f"worker {os.getpid()} {process_start(os.getpid())}")
        return True

    def restore(self) -> None:
        if self._previous is None:
            return
        with contextlib.suppress(ValueError):
            if signal.getsignal(NOTICE) == self._handle:
                signal.signal(NOTICE, self._previous)
        WATCH.unsubscribe(self._subscription)
        self._subscription = None
        with contextlib.suppress(OSError):
            self._registry.append(f"left {os.getpid()}")
        self._registry.close()
        self._previous = None

    def _handle(self, _signum, _frame) -> None:
        if not WATCH.settle(self._subscription):  # not told from the watch thread already
            self._told()

    def _told(self) -> None:
        with contextlib.suppress(Exception):  # recording must never fail the worker
            failure = self._registry.last("failure")
            if failure is not None and self._failed is not None and not self._failure_told:
                self._failure_told = True
                self._failed(json.loads(failure))
            else:
                self._record(self._registry.last("signal") or None)


class WorkerStops:
    """Every stop request a worker can hear of, recorded by `record(signal_name, detail)`: a
    SIGINT/SIGTERM of its own (handlers chained in front of vLLM's, `stop_signals`) and its
    engine core's NOTICE (`WorkerNotice`: vLLM kills a served engine core's workers before any
    signal reaches them). `restore()` at shutdown puts vLLM's handlers back."""

    def __init__(self, record: Callable[[str, str], None], failed: Callable[[str], None] | None = None):
        self.signals = StopSignals(lambda name: record(name, ""))
        self.notice = WorkerNotice(lambda name: record(name, "received by vLLM's engine core, which told this worker"),
                                   failed)

    @classmethod
    def into(cls, recorder) -> "WorkerStops":
        """Written to `recorder`'s log at any bytecode: a stop as a `stop` record, the engine core's
        failure as a `fault` (`ENGINE_FAILURE`) at the step the worker is in."""
        audit = recorder.audit
        def failed(message: str) -> None:
            audit.write_in_handler("fault", recorder.step_id, {
                "error": ENGINE_FAILURE, "message": f"vLLM's engine core failed ({message}) and told this worker"})
        return cls(lambda name, detail: audit.stop(recorder.step_id, "signal", name, detail=detail), failed)

    def install(self) -> None:
        self.signals.install()
        self.notice.install()

    def restore(self) -> None:
        self.signals.restore()
        self.notice.restore()
