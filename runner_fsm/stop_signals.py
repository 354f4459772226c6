"""A stop request is a record: SIGINT and SIGTERM are written to the audit log the moment they
arrive (DESIGN section 11, "A stop is a record").

`StopSignals(record).install()` puts a handler in front of the one already installed for each
signal (vLLM's worker and engine-core handlers, Python's `KeyboardInterrupt`, the default
action): it calls `record(signal_name)`, then hands the signal on to that previous handler, so
the process stops exactly as it would have. `restore()` puts the previous handlers back (only
where ours is still the one installed: whoever replaced it since keeps their own).

Python runs a handler only in the main thread, between two bytecodes: a rank blocked in C (a
gloo collective, an idle wait the kernel did not interrupt) would run it only when that call
returns, maybe after vLLM's SIGKILL. So the arrival is also heard from `signal_watch`'s thread
the moment it happens (`early`, the default), and recorded from there; the handler then only
hands the signal on. Where no watch can run (another wakeup fd is set), the handler records, and
a rank killed before it runs leaves no record: its peers' records of the same stop explain its
end (`audit.stops`). `record` must be safe to call at any bytecode and from another thread:
`AuditLog.stop` is (`write_in_handler`).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

from runner_fsm.signal_watch import WATCH, Subscription

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Chained SIGINT/SIGTERM handlers that record the request, then do what was done before."""

    def __init__(self, record: Callable[[str], None], early: bool = True):
        self._record = record
        self._early = early  # also heard from the watch thread (see the module's docstring)
        self._previous: dict[int, object] = {}
        self._subscriptions: dict[int, Subscription | None] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Chain in front of the current handlers; False where that is impossible (not the main
        thread, where Python refuses to set handlers; or a handler set outside Python)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is None:  # installed from C: it could not be handed on, nor put back
                continue
            signal.signal(signum, self._handle)
            self._previous[signum] = previous
            if self._early:
                self._subscriptions[signum] = WATCH.subscribe(signum, self._heard)
        return self.installed

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()
        for subscription in self._subscriptions.values():
            WATCH.unsubscribe(subscription)
        self._subscriptions.clear()

    @property
    def early(self) -> bool:
        """Whether arrivals are heard from the watch thread (False: from the handler only)."""
        return any(s is not None for s in self._subscriptions.values())

    def _heard(self, signum: int) -> None:
        """From the watch thread, the moment the signal arrives."""
        self._record(signal.Signals(signum).name)

    def _handle(self, signum: int, frame) -> None:
        if not WATCH.settle(self._subscriptions.get(signum)):  # not recorded from the watch yet
            try:
                self._record(signal.Signals(signum).name)
            except Exception:  # noqa: BLE001 - recording must never change how the signal is handled
                pass
        hand_on(self._previous.get(signum, signal.SIG_DFL), signum, frame)


def hand_on(previous, signum: int, frame) -> None:
    """Do what `previous` (a handler as `signal.getsignal` returns it) would have done."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:  # the default action (terminate): take it, as if never caught
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: ignored, as before
