"""A stop request is a record: SIGINT and SIGTERM are written to the audit log the moment they
arrive (DESIGN section 11, "A stop is a record").

`StopSignals(record).install()` puts a handler in front of the one already installed for each
signal (vLLM's worker and engine-core handlers, Python's `KeyboardInterrupt`, the default
action): it calls `record(signal_name)`, then hands the signal on to that previous handler, so
the process stops exactly as it would have. `restore()` puts the previous handlers back (only
where ours is still the one installed: whoever replaced it since keeps their own).

Python runs a handler only in the main thread, between two bytecodes. A rank blocked in a
collective (C++, gloo) runs it only when the collective returns; if it is killed first, it
leaves no record, and its peers' records of the same stop explain its end (`audit.stops`).
`record` must be safe to call at any bytecode: `AuditLog.stop` is (`write_in_handler`).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Chained SIGINT/SIGTERM handlers that record the request, then do what was done before."""

    def __init__(self, record: Callable[[str], None]):
        self._record = record
        self._previous: dict[int, object] = {}

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
        return self.installed

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
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
