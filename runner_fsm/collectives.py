"""Blocking collectives issued from async code: ordered, logged and watched.

Each process group gets a capacity limiter of 1, so its collectives run one at a time in a
worker thread and in the order the replica's task issued them (the same order on every
rank). Each call writes a collective `enqueue` record before it starts and `done` after it,
so a hang leaves the `enqueue` as the last line of the log. A watchdog turns a collective
that has not finished within `timeout_s` into `CollectiveTimeout`; the stuck thread is
abandoned (gloo cannot be interrupted) and the process is expected to exit.

A group without peers (`inline_groups`: one rank, e.g. the DP group of a single replica)
cannot wait on anyone, so its calls run inline in the calling task, with the same records:
the thread hop and the watchdog would cost more than the call and guard nothing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Sequence

import anyio

from runner_fsm.errors import CollectiveTimeout


class CollectiveRunner:
    """Runs blocking collectives per group; the heartbeat (if any) names culprits on a timeout."""

    def __init__(self, audit, timeout_s: float, *, heartbeat=None, inline_groups: Iterable[str] = ()):
        self._audit = audit
        self.timeout_s = timeout_s
        self._heartbeat = heartbeat
        self.inline_groups = frozenset(inline_groups)
        self._limiters: dict[str, anyio.CapacityLimiter | None] = {}
        self._seq: dict[str, itertools.count] = {}

    def _limiter(self, group: str) -> anyio.CapacityLimiter | None:
        """The group's limiter (None for an inline group); numbering starts at its first call."""
        try:
            return self._limiters[group]
        except KeyError:
            limiter = None if group in self.inline_groups else anyio.CapacityLimiter(1)
            self._limiters[group] = limiter
            self._seq[group] = itertools.count()
            return limiter

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
        limiter = self._limiter(group)
        pg_seq = next(self._seq[group])
        shapes = [list(s) for s in shapes]
        if self._heartbeat is not None:
            self._beat(step_id, phase, f"{group} {op} #{pg_seq}")
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "enqueue",
                                   **(enqueue_extra or {}))
        if limiter is None:
            result = fn(*args)
        else:
            result = await self._in_thread(limiter, fn, args, f"{op} on group {group!r} (pg_seq"
                                           f" {pg_seq}, phase {phase}) at step {step_id}")
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "done",
                                   **(done_extra(result) if done_extra else {}))
        if self._heartbeat is not None:
            self._beat(step_id, phase, "")
        return result

    async def _in_thread(self, limiter: anyio.CapacityLimiter, fn, args, where: str) -> Any:
        try:
            with anyio.fail_after(self.timeout_s):
                return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)
        except TimeoutError:
            raise CollectiveTimeout(f"{where} did not finish within {self.timeout_s:g} s"
                                    + self._peers()) from None
        except RuntimeError as exc:
            if not _peer_lost(exc):
                raise
            raise CollectiveTimeout(f"{where} failed: a peer is gone ({_first_line(exc)})"
                                    + self._peers()) from None

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
