"""vLLM's engine core hears of a stop before its workers do, and tells them: a vLLM plugin.

`vllm serve` stops (SIGTERM to the server; Ctrl-C with the default `--shutdown-timeout 0`) by
sending SIGTERM to each engine-core process and, at once, SIGKILL to it and to its worker
processes, workers first (`vllm.v1.utils.shutdown`, `kill_process_tree`): with SIGTERM to the
server alone, no signal ever reaches a worker, so FSMWorker could not record the stop itself.
vLLM loads its general plugins (entry point group `vllm.general_plugins`, declared in this
package's metadata) in every process it starts, its engine cores included (first thing in
`EngineCore.__init__`, after vLLM's own SIGINT/SIGTERM handlers are in place). There
`register()` chains a handler in front of vLLM's that hands NOTICE to every FSMWorker of this
engine core, which records the stop in its own log (`WorkerNotice`), then runs vLLM's handler.

An engine core that fails (an error in its busy loop: vLLM logs "EngineCore encountered a fatal
error." with the exception, then tears its workers down) tells its workers the same way, before
the teardown, and each records the failure as a `fault` (`ENGINE_FAILURE`): the SIGTERMs that
follow are vLLM's shutdown of a failing job, which replay reads as no stop request. The failure is
heard through a handler on vLLM's engine-core logger (`logging`'s public API; no vLLM code is
patched): a vLLM that words the message otherwise is told apart by no failure record, as before.

FSMWorker processes find their engine core through its environment: before vLLM starts them,
`register()` publishes a directory (REGISTRY_ENV), and each worker started from there puts a
file named after its pid in it. In any other process, or an engine core whose workers are
not FSMWorkers, nothing is told to anyone: NOTICE is a signal processes ignore unless they
asked for it, and it goes only to registered pids. vLLM itself is not changed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Callable

from runner_fsm.process.signal_watch import WATCH
from runner_fsm.process.stop_signals import StopSignals

NOTICE = signal.SIGWINCH  # ignored by default: a process that did not ask for it is untouched
REGISTRY_ENV = "RUNNER_FSM_ENGINE_REGISTRY"
_SIGNAL_FILE = "signal"  # the name of the signal the engine core received
_FAILURE_FILE = "failure"  # what the engine core failed with
ENGINE_FAILURE = "EngineCoreFailure"  # the `fault` record's error: vLLM's engine core failed
_ENGINE_LOGGER, _FATAL = "vllm.v1.engine.core", "EngineCore encountered a fatal error"  # vLLM's words
_PREFIX = "runner-fsm-engine-"  # + the engine core's pid


def register() -> None:
    """vLLM's plugin entry point, called in every vLLM process (maybe more than once)."""
    if not multiprocessing.current_process().name.startswith("EngineCore") or REGISTRY_ENV in os.environ:
        return
    _remove_stale_registries()
    pid = os.getpid()  # the name says which process made it, in which PID namespace (`_remove_stale_registries`)
    registry = tempfile.mkdtemp(prefix=f"{_PREFIX}{pid}-{process_start(pid)}-{_pid_namespace()}-")
    atexit.register(shutil.rmtree, registry, ignore_errors=True)  # vLLM kills engine cores: see above
    os.environ[REGISTRY_ENV] = registry  # inherited by the worker processes vLLM starts from here
    StopSignals(lambda name: tell_workers(registry, name)).install()
    logging.getLogger(_ENGINE_LOGGER).addHandler(_FailureHandler(registry))


def _remove_stale_registries() -> None:
    """The registries of engine cores that are gone (vLLM SIGKILLs them, so atexit never runs):
    only those made in this PID namespace by a process that is no longer there (its pid gone, or
    held by a process started at another time). Another namespace's (a container sharing /tmp)
    cannot be judged from here, nor a name of another form: left alone."""
    namespace = _pid_namespace()
    for path in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        pid, start, space = (path.name[len(_PREFIX):].split("-") + ["", "", ""])[:3]
        if namespace and space == namespace and pid.isdigit() and start.isdigit() and process_start(int(pid)) != start:
            shutil.rmtree(path, ignore_errors=True)


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22): with the
    pid, it names one process, where a pid alone may be reused. None: no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str:
    try:
        return "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit())
    except OSError:
        return ""


class _FailureHandler(logging.Handler):
    """On vLLM's engine-core logger: its fatal error, told to the workers before the teardown."""

    def __init__(self, registry: str):
        super().__init__(logging.ERROR)
        self._registry = registry

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is None or not str(record.msg).startswith(_FATAL):
            return
        error = record.exc_info[1]
        with contextlib.suppress(Exception):  # telling must never change how vLLM fails
            tell_workers(self._registry, failure=f"{type(error).__name__}: {error}")


def tell_workers(registry: str, signal_name: str | None = None, failure: str | None = None) -> None:
    """Hand NOTICE to each FSMWorker registered in `registry` (from a signal handler), with the
    signal the engine core received, or what it failed with."""
    if failure is not None:
        (Path(registry) / _FAILURE_FILE).write_text(failure)
    else:
        (Path(registry) / _SIGNAL_FILE).write_text(str(signal_name))
    for entry in os.scandir(registry):
        if entry.name.isdigit() and int(entry.name) != os.getpid():  # a worker inside: it heard the signal
            with contextlib.suppress(OSError):
                # the process that registered, not another that holds its pid now (a SIGKILLed
                # worker leaves its entry behind)
                if Path(entry.path).read_text().strip() == process_start(int(entry.name)):
                    os.kill(int(entry.name), NOTICE)


class WorkerNotice:
    """A worker's side: registered with its engine core, NOTICE recorded as the engine's stop."""

    def __init__(self, record: Callable[[str], None], failed: Callable[[str], None] | None = None):
        """`record(signal_name)`: the engine core's stop; `failed(message)`: its failure."""
        self._record, self._failed = record, failed
        self._failure_told = False  # once: the engine core's SIGTERM after its failure is a signal again
        self._registry = os.environ.get(REGISTRY_ENV)
        self._previous = None
        self._subscription = None  # heard from the watch thread too (`signal_watch`)

    def install(self) -> bool:
        """Register this process with its engine core (False: none published a registry here)."""
        registry = self._registry
        if not registry or not os.path.isdir(registry):
            return False
        try:
            self._previous = signal.signal(NOTICE, self._handle)
        except ValueError:  # not the main thread: Python sets no handler here
            return False
        self._subscription = WATCH.subscribe(NOTICE, lambda _signum: self._told())
        Path(registry, str(os.getpid())).write_text(process_start(os.getpid()) or "")
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
            Path(self._registry, str(os.getpid())).unlink()
        self._previous = None

    def _handle(self, _signum, _frame) -> None:
        if not WATCH.settle(self._subscription):  # not told from the watch thread already
            self._told()

    def _told(self) -> None:
        failure = _read(Path(self._registry, _FAILURE_FILE))
        with contextlib.suppress(Exception):  # recording must never fail the worker
            if failure is not None and self._failed is not None and not self._failure_told:
                self._failure_told = True
                self._failed(failure)
            else:
                self._record(_read(Path(self._registry, _SIGNAL_FILE)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


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
