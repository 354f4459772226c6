"""Start a DP x PCP job as local processes joined by gloo process groups on 127.0.0.1.

Nothing a job opens listens beyond the loopback interface unless asked: rank 0's rendezvous
store (a c10d `TCPStore`) listens on a socket bound to `host` (default 127.0.0.1; c10d's own
`tcp://` and `env://` paths bind every interface), and gloo uses the interface named by
`GLOO_SOCKET_IFNAME`, `lo` unless the user set it.

`spawn(fn, layout, *args)` runs `fn(groups, *args)` in one process per global rank and returns
the per-rank results. It never hangs: past its deadline it kills every child and raises, and
when a child raises it kills the others at once (they may be blocked in a collective with it).
A child leaves with `os._exit` after reporting and flushing logging and stdio: anything `fn`
leaves buffered elsewhere must be flushed by `fn` itself. The children's side is
`engine.rank_main`; this side imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.rendezvous import LOOPBACK, free_port
from runner_fsm.process.stop_signals import StopSignals

# How long a child that exited without a result may still have one in flight (read from its pipe).
_EXIT_GRACE_S = 0.5
_POLL_S = 0.05
# How long children that all reported may take to leave their final barrier.
_JOIN_GRACE_S = 3.0
# How long the ranks of a job told to stop (SIGTERM, forwarded) may take to record it and go.
_STOP_GRACE_S = 2.0


class SpawnError(RuntimeError):
    """A child process raised or died; names the rank and carries the child's traceback."""

    def __init__(self, message: str, rank: int, exc_type: str = "", child_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.child_traceback = child_traceback


class SpawnTimeout(TimeoutError):
    """The job did not finish by its deadline; every child was killed."""

    def __init__(self, message: str, pending_ranks: list[int]):
        super().__init__(message)
        self.pending_ranks = pending_ranks


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """In `collect_failures` mode, the result of a rank that raised, died or was killed."""

    rank: int
    exc_type: str
    message: str
    exitcode: int | None = None


def spawn(
    fn: Callable[..., Any] | str,
    layout: ParallelLayout,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float | None = None,
    collect_failures: bool = False,
    host: str = LOOPBACK,
    failed: Callable[[Any], bool] | None = None,
    on_stop: Callable[[str, list[int], list[int]], None] | None = None,
    fresh_interpreters: bool = False,
) -> list[Any]:
    """Run `fn(groups, *args)` on every global rank; return the results in rank order.

    `fn` must be importable at module level (it is pickled by name), or named as "module:function":
    each rank then imports it before it joins the job's groups, and this process never does (the
    embedded engine's launcher, which imports no torch, names its ranks' entry so).
    `timeout_s` bounds the whole job, start-up included; `pg_timeout_s` (default `timeout_s`)
    bounds each collective inside it. By default the first failing rank raises and the
    others are killed; with `collect_failures` each failure becomes a `RankFailure` in the
    results and the other ranks are waited for (until the deadline), so every rank's own
    error is seen. `host` is the address rank 0's store listens on (loopback by default).
    When `failed(result)` holds for a result, the children are ended as soon as every rank
    has reported, instead of being given time to leave their groups. `on_stop(signal_name,
    alive_ranks, gone_ranks)`: told of a stop request to the launcher before any rank is (the
    stop recorded where it started, `process.stop_requests`); it must not raise.
    `fresh_interpreters`: start each rank as a new interpreter (`spawn`), leaving nothing outside
    the run when the job is killed whole; by default ranks are forks of a fork server
    (`_start_context`), whose socket lies in TMPDIR while this process lives.
    """
    layout.validate()
    context = mp.get_context("spawn") if fresh_interpreters else _start_context()
    # One pipe per rank for its result: a `Queue` is guarded by named POSIX semaphores
    # (/dev/shm/sem.mp-*) that only the launcher's resource tracker removes, and a job killed
    # whole (SIGKILL to its process group) leaves them behind; a pipe is gone with its holders.
    pipes = [context.Pipe(duplex=False) for _ in range(layout.world_size)]
    port = free_port(host)
    deadline = time.monotonic() + timeout_s
    # The launcher's environment as it is now, with the children's settings: a fork server's
    # children would otherwise see the server's, taken when it started (an earlier job's).
    child_env = {**os.environ, **_CHILD_ENV}
    child_args = (fn, layout, host, port, args, pg_timeout_s or timeout_s, child_env)
    processes: list[mp.process.BaseProcess] = []
    # A stop request to the launcher (SIGINT, SIGTERM) reaches every rank as the same signal,
    # which each records in its audit log (`stop_signals`) before it goes; then the launcher
    # stops as before. The same signal, not SIGTERM for both: after a Ctrl-C (SIGINT to the
    # whole group) a rank heard the launcher's SIGTERM before the group's SIGINT, 3 runs in 20
    # on a loaded box (each signal lands in whichever of its threads the kernel picks), and its
    # log named SIGTERM as the request. early=False: this main thread waits in Python, so its
    # handler runs at once; and it stops the ranks, which is the handler's work, not a watch's.
    def stopping(name: str) -> None:
        if on_stop is not None:
            alive = [rank for rank, process in enumerate(processes) if process.is_alive()]
            on_stop(name, alive, sorted(set(range(len(processes))) - set(alive)))
        _stop_all(processes, signal.Signals[name])

    stops = StopSignals(stopping, early=False)
    stops.install()
    try:
        with _single_threaded_children():
            for rank in range(layout.world_size):
                process = context.Process(
                    target=_child_main, args=(rank, *child_args, pipes[rank][1]), name=f"runner-rank-{rank}"
                )
                process.start()
                processes.append(process)
                pipes[rank][1].close()  # the child's end: its exit is then the reader's end of file
        results = _collect(processes, [reader for reader, _ in pipes], deadline, collect_failures)
        if not any(isinstance(r, RankFailure) or (failed is not None and failed(r)) for r in results.values()):
            _join_all(processes, min(deadline, time.monotonic() + _JOIN_GRACE_S))
        # else a failed run: every rank has reported (and read from the store what named the
        # culprit), so nothing needs the children; their groups may be stuck behind abandoned
        # collectives until the gloo timeout, so they are ended now (`finally`), not waited for.
        return [results[rank] for rank in range(layout.world_size)]
    finally:
        stops.restore()
        _kill_all(processes)
        for reader, writer in pipes:
            reader.close()
            writer.close()


def _child_main(*args) -> None:
    """A rank's process (`engine.rank_main`, which imports torch: this module does not)."""
    from runner_fsm.engine.rank_main import child_main

    child_main(*args)


def _collect(processes, readers, deadline: float, collect_failures: bool = False) -> dict[int, Any]:
    results: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    open_readers = list(readers)
    while len(results) < len(processes):
        now = time.monotonic()
        if now >= deadline:
            pending = [rank for rank in range(len(processes)) if rank not in results]
            if collect_failures:
                for rank in pending:
                    results[rank] = RankFailure(rank, "SpawnTimeout", "killed at the job's deadline")
                return results
            raise SpawnTimeout(
                f"ranks {pending} did not finish before the deadline; killed every child",
                pending,
            )
        message = _next_result(open_readers, min(_POLL_S, deadline - now))
        if message is None:
            for failure in _dead_without_result(processes, results, dead_since):
                if not collect_failures:
                    raise SpawnError(failure.message, rank=failure.rank)
                results[failure.rank] = failure
            continue
        rank, ok, payload = message
        if not ok:
            exc_type, message, child_traceback = payload
            if collect_failures:
                results[rank] = RankFailure(rank, exc_type, message)
                continue
            raise SpawnError(
                f"rank {rank} raised {exc_type}: {message}\n--- traceback of rank {rank} ---\n"
                f"{child_traceback}",
                rank=rank,
                exc_type=exc_type,
                child_traceback=child_traceback,
            )
        results[rank] = pickle.loads(payload)
    return results


def _next_result(readers: list, timeout: float):
    """The next rank's report from any of `readers`, or None after `timeout`; a reader at its end
    of file (its rank gone, reported or not) is dropped from `readers`."""
    for reader in mp_connection.wait(readers, timeout=max(0.0, timeout)):
        try:
            return reader.recv()
        except (EOFError, OSError):
            readers.remove(reader)
    if not readers:
        time.sleep(max(0.0, timeout))  # every rank's pipe closed: only `_dead_without_result` is left to say
    return None


def _dead_without_result(processes, results: dict[int, Any], dead_since: dict[int, float]) -> list[RankFailure]:
    """Children that exited without a result once their last message had time to land."""
    now = time.monotonic()
    failures = []
    for rank, process in enumerate(processes):
        if rank in results or process.is_alive():
            continue
        first_seen = dead_since.setdefault(rank, now)
        if now - first_seen >= _EXIT_GRACE_S:
            failures.append(RankFailure(
                rank, "ProcessDied",
                f"rank {rank} exited with code {process.exitcode} without reporting a result",
                process.exitcode))
    return failures


def _join_all(processes, deadline: float) -> None:
    """Every result is in: wait for the children to leave, then end the stragglers."""
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


def _stop_all(processes, signum: signal.Signals) -> None:
    """`signum` to every child still running, then a moment for them to record it and leave."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        with contextlib.suppress(ProcessLookupError):  # it left since
            os.kill(process.pid, signum)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in alive:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


def _kill_all(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5.0)


def _start_context() -> mp.context.BaseContext:
    """Ranks start from multiprocessing's fork server where the platform has one (POSIX): it is
    started once per launcher with torch and this module imported, and each rank is a fork of it,
    ready in milliseconds. Started with `spawn`, each rank imported torch itself (1.5 s of CPU on
    a 2-core CI box): the embedded tests marked `multiproc` took 48% less CPU with the server.
    The server is the launcher's child, in its process group, and ends with it. What torch reads
    of the environment when it is imported (the first job's `_CHILD_ENV`, set while the server
    starts) is the server's; everything read later is the launcher's at `spawn` (`child_env`)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "runner_fsm.engine.rank_main", __name__])
    return context


# OMP must see 1 thread before torch loads, and gloo listens on the loopback interface only
# (nothing beyond 127.0.0.1), unless the user chose an interface. Torch loads before any rank
# code runs (a fresh interpreter unpickling `_child_main`, or the fork server at its start), so
# these are in the launcher's environment while processes start (`_single_threaded_children`);
# each rank also gets them in `child_env`.
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
