"""Blocking collectives issued from async code: ordered, logged and watched.

Each process group gets a capacity limiter of 1, so its collectives run one at a time in a
worker thread and in the order the replica's task issued them (the same order on every
rank). Each call writes a collective `enqueue` record before it starts and `done` after it,
so a hang leaves the `enqueue` as the last line of the log. A watchdog turns a collective
that has not finished within `timeout_s` into `CollectiveTimeout`; the stuck thread is
abandoned (gloo cannot be interrupted) and the process is expected to exit.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import anyio

from runner_fsm.errors import CollectiveTimeout


class CollectiveRunner:
    """Runs blocking collectives per group; `describe_peers()` feeds timeout messages."""

    def __init__(self, audit, timeout_s: float, *, describe_peers: Callable[[], str] = lambda: ""):
        self._audit = audit
        self.timeout_s = timeout_s
        self._describe_peers = describe_peers
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self._seq: dict[str, itertools.count] = {}

    def _limiter(self, group: str) -> anyio.CapacityLimiter:
        if group not in self._limiters:
            self._limiters[group] = anyio.CapacityLimiter(1)
            self._seq[group] = itertools.count()
        return self._limiters[group]

    async def run(
        self,
        group: str,
        op: str,
        fn: Callable[..., Any],
        *args: Any,
        step_id: int | None,
        phase: int = 0,
        shapes: Sequence[Sequence[int]] = (),
    ) -> Any:
        """`fn(*args)` in `group`'s worker thread, with audit records and the watchdog."""
        limiter = self._limiter(group)
        pg_seq = next(self._seq[group])
        shapes = [list(s) for s in shapes]
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "enqueue")
        try:
            with anyio.fail_after(self.timeout_s):
                result = await anyio.to_thread.run_sync(
                    fn, *args, limiter=limiter, abandon_on_cancel=True
                )
        except TimeoutError:
            peers = self._describe_peers()
            raise CollectiveTimeout(
                f"{op} on group {group!r} (pg_seq {pg_seq}) at step {step_id} did not finish"
                f" within {self.timeout_s:g} s" + (f"; last known: {peers}" if peers else "")
            ) from None
        if self._audit is not None:
            self._audit.collective(step_id, group, op, phase, shapes, pg_seq, "done")
        return result

    async def run_local(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (a forward, which logs its own collectives) in the compute thread,
        under the same watchdog."""
        limiter = self._limiter("compute")
        try:
            with anyio.fail_after(self.timeout_s):
                return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)
        except TimeoutError:
            peers = self._describe_peers()
            raise CollectiveTimeout(
                f"{getattr(fn, '__qualname__', fn)} did not finish within {self.timeout_s:g} s"
                + (f"; last known: {peers}" if peers else "")
            ) from None
