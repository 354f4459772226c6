"""A signal heard the moment it arrives, even while the main thread is blocked in C.

Python runs a signal's handler in the main thread only, between two bytecodes. A main thread
blocked in C (a gloo collective, a `Work.wait()`, a poll that the kernel did not interrupt
because it delivered the signal to another of the process's threads) runs the handler only
when that call returns: after vLLM's SIGKILL, which follows its SIGTERM at once, never.

CPython's own C-level handler does run at once, in whichever thread the kernel chose, and
where a wakeup fd is set (`signal.set_wakeup_fd`) it writes the signal's number there. The
process-wide `WATCH` sets one (only where nobody has: asyncio's loops use theirs, and keep
it), and a daemon thread waiting on it sees each arrival at once. That thread needs only the
GIL, which C calls that block release.

The Python handler stays first: it acts as before whenever it runs in time, and the watch
acts only for an arrival no handler has claimed `_HANDLER_GRACE_S` after it came (the main
thread was blocked). Each arrival is acted on once: the handler asks `settle(subscription)`
before it acts, which claims the arrival, or says the watch has acted on it already. The watch
acting only for a blocked main thread matters: a main thread interrupted in the middle of an
audit-log write holds the log's lock, and only it can write a record then (after its write).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Callable

_STOP_BYTE = 0  # no signal is numbered 0: the watch thread's own "stop"
# How long the watch leaves an arrival to the Python handler: a main thread that runs Python
# (or waits in a call the signal interrupts) runs it within microseconds to a few ms (the GIL's
# switch interval is 5 ms); vLLM's SIGKILL follows its SIGTERM within tens of ms.
_HANDLER_GRACE_S = 0.02


class Subscription:
    """One subscriber's interest in one signal (what `settle` is asked about)."""

    __slots__ = ("signum", "callback", "waiting", "claimed", "handed", "live")

    def __init__(self, signum: int, callback: Callable[[int], None]):
        self.signum = signum
        self.callback = callback
        self.waiting = 0  # arrivals the watch read, left to the handler for now
        self.claimed = 0  # arrivals the handler claimed before the watch read them
        self.handed = 0  # arrivals the watch acted on that the handler has not settled
        self.live = True


class SignalWatch:
    def __init__(self) -> None:
        # Reentrant: a Python handler may run inside another, on the main thread, while it holds this.
        self._lock = threading.Condition(threading.RLock())
        self._subscriptions: dict[int, list[Subscription]] = {}
        self._pipe: tuple[int, int] | None = None  # (read end, write end = the wakeup fd)

    @property
    def active(self) -> bool:
        return self._pipe is not None

    def subscribe(self, signum: int, callback: Callable[[int], None]) -> Subscription | None:
        """Call `callback(signum)` from the watch thread for each arrival of `signum` that no
        handler claimed (`settle`) in `_HANDLER_GRACE_S`; None where no watch can run (not the
        main thread, or another wakeup fd is set)."""
        with self._lock:
            if not self._start():
                return None
            subscription = Subscription(signum, callback)
            self._subscriptions.setdefault(signum, []).append(subscription)
            return subscription

    def unsubscribe(self, subscription: Subscription | None) -> None:
        if subscription is None:
            return
        with self._lock:
            subscription.live = False
            self._lock.notify_all()  # the watch waits for no handler of it any more
            listed = self._subscriptions.get(subscription.signum, [])
            if subscription in listed:
                listed.remove(subscription)
            if not any(self._subscriptions.values()):
                self._stop()

    def settle(self, subscription: Subscription | None) -> bool:
        """Called by the Python handler of `subscription.signum` before it acts: True when the
        watch has acted on this arrival already (the handler must not again); False when the
        handler is to act, the arrival now claimed (the watch will not)."""
        if subscription is None or not subscription.live:
            return False
        with self._lock:
            if subscription.waiting:
                subscription.waiting -= 1
                self._lock.notify_all()
                return False
            if subscription.handed:
                subscription.handed -= 1
                return True
            subscription.claimed += 1  # its byte is still in the pipe: the watch skips it
            return False

    # -- the watch thread and its pipe

    def _start(self) -> bool:
        if self._pipe is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False  # Python sets the wakeup fd from the main thread only
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)  # the C handler must never block on it
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:  # refused, or someone's own (an asyncio loop's): theirs stays
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return False
        self._pipe = (read_end, write_end)
        threading.Thread(target=self._run, args=(read_end, write_end), name="runner-fsm-signal-watch",
                         daemon=True).start()
        return True

    def _stop(self) -> None:
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return  # off the main thread the wakeup fd cannot be reset: the watch stays, idle
        read_end, write_end = self._pipe
        _release_wakeup_fd(write_end)
        self._pipe = None
        with contextlib.suppress(OSError):
            os.write(write_end, bytes([_STOP_BYTE]))  # the thread closes both ends

    def _run(self, read_end: int, write_end: int) -> None:
        try:
            while True:
                select.select([read_end], [], [])
                with self._lock:
                    if self._pipe != (read_end, write_end):
                        return  # stopped (or forgotten after a fork)
                    self._drain(read_end, write_end)
        finally:
            _close(read_end, write_end)

    def _drain(self, read_end: int, write_end: int) -> None:
        """The watch thread, under the lock: each arrival in the pipe left to its handler for
        `_HANDLER_GRACE_S`, then acted on here if no handler claimed it. The lock is let go while
        it waits (`_arrived`): the main thread may stop the watch meanwhile, and then it reads no more."""
        while self._pipe == (read_end, write_end):
            try:
                arrived = os.read(read_end, 256)
            except OSError:  # BlockingIOError: all read
                return
            if not arrived:
                return
            for signum in arrived:
                self._arrived(list(self._subscriptions.get(signum, ())))

    def _arrived(self, subscriptions: list[Subscription]) -> None:
        left = []
        for subscription in subscriptions:
            if subscription.claimed:
                subscription.claimed -= 1  # its handler ran first and acted
            else:
                subscription.waiting += 1
                left.append(subscription)
        deadline = time.monotonic() + _HANDLER_GRACE_S
        for subscription in left:
            while subscription.waiting and subscription.live and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())  # the lock (and the GIL) free meanwhile
            if subscription.waiting and subscription.live:  # no handler came: the main thread is blocked
                subscription.waiting -= 1
                with contextlib.suppress(Exception):  # a subscriber must never stop the watch
                    subscription.callback(subscription.signum)
                subscription.handed += 1

    def _forget_after_fork(self) -> None:
        """In a forked child: the pipe is the parent's and its thread did not come along."""
        self._lock = threading.Condition(threading.RLock())
        for listed in self._subscriptions.values():
            for subscription in listed:
                subscription.live = False
        self._subscriptions = {}
        if self._pipe is not None:
            read_end, write_end = self._pipe
            self._pipe = None
            with contextlib.suppress(ValueError):  # forked from a thread Python does not take as main
                _release_wakeup_fd(write_end)
            _close(read_end, write_end)


def _release_wakeup_fd(ours: int) -> None:
    """No wakeup fd where `ours` is still the one set; one set since (an asyncio loop's) stays."""
    current = signal.set_wakeup_fd(-1)
    if current != ours:
        signal.set_wakeup_fd(current)


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


WATCH = SignalWatch()
os.register_at_fork(after_in_child=WATCH._forget_after_fork)
