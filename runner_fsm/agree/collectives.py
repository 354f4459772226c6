"""Blocking collectives issued from async code: ordered, logged and watched.

Each process group gets one worker thread, so its collectives run one at a time and in the
order the replica's task issued them (the same order on every rank). Each call writes a
collective `enqueue` record before it starts and `done` after it, so a hang leaves the
`enqueue` as the last line of the log. A watchdog turns a collective that has not finished
within `timeout_s` into `CollectiveTimeout`; the stuck thread is abandoned (gloo cannot be
interrupted), the group gets a fresh one, and the process is expected to exit.

The worker is a plain thread fed through a queue, answering on the asyncio event loop
(anyio's default backend, the one this package runs on) with `call_soon_threadsafe`: one
wake-up each way per collective. (anyio's `to_thread` adds an
event-loop round trip, a capacity limiter and a cancel scope per call, about as much again.)

A group without peers (`inline_groups`: one rank, e.g. the DP group of a single replica)
cannot wait on anyone, so its calls run inline in the calling task, with the same records:
the thread hop and the watchdog would cost more than the call and guard nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import Any, Callable, Iterable, Sequence

import anyio

from runner_fsm.errors import CollectiveTimeout


class _GroupThread:
    """The worker thread of one group: runs submitted calls in order, answers on their loop."""

    def __init__(self, group: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"runner-fsm-{group}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:  # handed to the caller, whatever it is
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop closed while we ran: nobody waits any more
                pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller timed out or was cancelled: the answer is dropped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class CollectiveRunner:
    """Runs blocking collectives per group; the heartbeat (if any) names culprits on a timeout."""

    def __init__(self, audit, timeout_s: float, *, heartbeat=None, inline_groups: Iterable[str] = ()):
        self._audit = audit
        self.timeout_s = timeout_s
        self._heartbeat = heartbeat
        self.inline_groups = frozenset(inline_groups)
        self._threads: dict[str, _GroupThread | None] = {}
        self._seq: dict[str, itertools.count] = {}

    def _thread(self, group: str) -> _GroupThread | None:
        """The group's worker (None for an inline group); numbering starts at its first call."""
        try:
            return self._threads[group]
        except KeyError:
            worker = None if group in self.inline_groups else _GroupThread(group)
            self._threads[group] = worker
            self._seq[group] = itertools.count()
            return worker

    def close(self) -> None:
        """Let the worker threads end (idempotent); a stuck one stays abandoned."""
        for worker in self._threads.values():
            if worker is not None:
                worker.stop()
        self._threads = {group: None for group in self._threads}

    async def run(
        self,
        group: str,
        op: str,
        fn: Callable[..., Any],
        *args: Any,
        step_id: int | None,
        phase: int = 0,
        shapes: Sequence[Sequence[int]] = (),
        enqueue_extra: dict | None = None,
        done_extra: Callable[[Any], dict] | None = None,
    ) -> Any:
        """`fn(*args)` in `group`'s worker thread under the watchdog (inline for a group without
        peers), between its `enqueue` and `done` records.

        `enqueue_extra` is logged with the enqueue record, `done_extra(result)` with done.
        """
        worker = self._thread(group)
        pg_seq = next(self._seq[group])
        shapes = [list(s) for s in shapes]
        if self._heartbeat is not None:
            self._beat(step_id, phase, f"{group} {op} #{pg_seq}")
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "enqueue",
                                   **(enqueue_extra or {}))
        try:
            if worker is None:
                result = fn(*args)
            else:
                result = await self._in_thread(group, worker, fn, args, f"{op} on group {group!r} (pg_seq"
                                               f" {pg_seq}, phase {phase}) at step {step_id}")
        except CollectiveTimeout:
            raise  # still where its peers wait: its position stays
        except BaseException:
            # It refused or failed the call itself (a check inside it): it will not join, so
            # its position says so, and a peer's timeout names it rather than nobody.
            self._beat(step_id, phase, "")
            raise
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "done",
                                   **(done_extra(result) if done_extra else {}))
        if self._heartbeat is not None:
            self._beat(step_id, phase, "")
        return result

    async def _in_thread(self, group: str, worker: _GroupThread, fn, args, where: str) -> Any:
        future = worker.submit(fn, args)
        try:
            with anyio.fail_after(self.timeout_s):
                return await future
        except TimeoutError:
            raise CollectiveTimeout(f"{where} did not finish within {self.timeout_s:g} s"
                                    + self._peers()) from None
        except RuntimeError as exc:
            if not _peer_lost(exc):
                raise
            raise CollectiveTimeout(f"{where} failed: a peer is gone ({_first_line(exc)})"
                                    + self._peers()) from None
        finally:
            if not future.done() or future.cancelled():  # abandoned: later calls get a fresh thread
                worker.stop()
                self._threads[group] = _GroupThread(group)

    def _beat(self, step_id, phase: int, collective: str) -> None:
        if self._heartbeat is not None and step_id is not None:
            self._heartbeat.beat(step_id, phase, collective)

    def _peers(self) -> str:
        return f"; {self._heartbeat.describe()}" if self._heartbeat is not None else ""

    async def stall(self, step_id: int) -> None:
        """Stop before the next collective (fault injection `hang`), under the watchdog."""
        try:
            with anyio.fail_after(self.timeout_s):
                await anyio.sleep_forever()
        except TimeoutError:
            raise CollectiveTimeout(f"step {step_id}: stalled before its next collective (injected"
                                    f" hang) for {self.timeout_s:g} s" + self._peers()) from None


# gloo reports a peer that died mid-collective as a RuntimeError from its transport.
_PEER_LOST_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                      "pair.cc")


def _peer_lost(exc: RuntimeError) -> bool:
    return any(marker in str(exc) for marker in _PEER_LOST_MARKERS)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
