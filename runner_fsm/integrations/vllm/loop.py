"""One persistent event loop for the replica runner, called synchronously by vLLM.

vLLM calls the worker from its own (synchronous) thread, the runner is async (anyio; the
state machine needs the asyncio backend). A blocking portal owns one asyncio loop in a
dedicated thread for the worker's whole life: every call runs on that same loop, so the
runner's limiters and the state machine never see a second loop, and nothing is re-created
per step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from anyio.from_thread import BlockingPortal, start_blocking_portal


class RunnerLoop:
    """`call(fn, *args)` runs `fn` (sync or async) on the loop thread and returns its result."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = self._stack.enter_context(
            start_blocking_portal(backend="asyncio"))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._portal is None:
            raise RuntimeError("the runner loop is closed")
        return self._portal.call(fn, *args)

    @property
    def closed(self) -> bool:
        return self._portal is None

    def close(self) -> None:
        if self._portal is not None:
            self._portal = None
            self._stack.close()
