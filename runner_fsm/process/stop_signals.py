"""A stop request is a record: SIGINT and SIGTERM are written to the audit log the moment they
arrive (DESIGN section 11, "A stop is a record"). One the process ignores (its launcher's
choice: nohup, a background job of a non-interactive shell) stays ignored and is no stop.

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
end (`rules.stops`). `record` must be safe to call at any bytecode and from another thread:
`AuditLog.stop` is (`write_in_handler`).

A handler that lands while its own thread writes a record finds the log's lock held: the record
waits behind that write. The default action of SIGTERM, taken inside the handler, kills the
process before the write ends, and the record is lost (26 of 40 SIGTERMs to a process writing
records in a loop). A process whose main thread runs an event loop uses `stops_on_loop`: it hands
each signal on from the loop, which runs once the write and the record behind it are done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import AsyncIterator, Callable, Iterator

import anyio

from runner_fsm.process.signal_watch import WATCH, Subscription

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
            if previous == signal.SIG_IGN:  # the launcher ignores it (nohup, a background job): so
                continue  # does the process, as Python leaves such a SIGINT alone; no stop to record
            signal.signal(signum, self._handle)
            self._previous[signum] = previous
            if self._early:
                self._subscriptions[signum] = WATCH.subscribe(signum, self._heard)
        return self.installed

    def restore(self, keep: tuple[int, ...] = ()) -> None:
        """The previous handlers back; those of `keep` stay chained (recording, without the watch)
        until a later `restore()`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(self._previous.items()):
            if signum in keep:
                continue
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
            del self._previous[signum]
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
        with arrivals_held() as held:  # another stop while this one is written waits for the write
            if not WATCH.settle(self._subscriptions.get(signum)):  # not recorded from the watch yet
                try:
                    self._record(signal.Signals(signum).name)
                except Exception:  # noqa: BLE001 - recording must never change how the signal is handled
                    pass
        hand_on_in_order([(self._previous.get(signum, signal.SIG_DFL), signum), *held], frame)


@contextlib.contextmanager
def arrivals_held() -> Iterator[list]:
    """For a stop record written on the main thread: a SIGINT or SIGTERM arriving meanwhile is held
    until the write is done, then handed on (`hand_on_in_order`) to the handler that was in place,
    given as the list of (handler, signum) this yields.

    A Ctrl-C reaches an embedded rank twice: the group's SIGINT, and the launcher's relay of it
    about a millisecond later. The relay's handler ran inside the first one's record, recorded
    nothing itself (the log's lock was its own thread's), and handed on (`KeyboardInterrupt`)
    there: the write was abandoned with both records and the rank's log ended at its `job`
    record (3 runs in 60 of tests/test_stop_race.py; seen in a trace: the second handler between
    the first's lock and its line). Nested, the inner region hands what it held to the outer's."""
    held: list = []
    if threading.current_thread() is not threading.main_thread():  # no handler runs there anyway
        yield held
        return
    in_place = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def hold(signum: int, frame) -> None:
        held.append((in_place[signum], signum))

    for signum, handler in in_place.items():
        if handler is not None and handler != signal.SIG_IGN:  # set from C, or ignored: left alone
            signal.signal(signum, hold)
    try:
        yield held
    finally:
        for signum, handler in in_place.items():
            if signal.getsignal(signum) is hold:
                signal.signal(signum, handler)


def hand_on_in_order(arrivals, frame) -> None:
    """`hand_on` each (handler, signum), in order; one that raises (`KeyboardInterrupt`) does not keep
    the next from its turn (a SIGTERM behind a SIGINT still takes its default action)."""
    if not arrivals:
        return
    (handler, signum), rest = arrivals[0], arrivals[1:]
    try:
        hand_on(handler, signum, frame)
    finally:
        hand_on_in_order(rest, frame)


def hand_on(previous, signum: int, frame) -> None:
    """Do what `previous` (a handler as `signal.getsignal` returns it) would have done."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:  # the default action (terminate): take it, as if never caught
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: ignored, as before


@contextlib.asynccontextmanager
async def stops_on_loop(record: Callable[[str], None], beneath: dict | None = None) -> AsyncIterator[None]:
    """SIGINT and SIGTERM recorded as `StopSignals(record, early=False)` records them, for the body
    of an anyio event loop in the main thread; what the previous handlers did (asyncio's SIGINT:
    cancel the run, then KeyboardInterrupt; SIGTERM's default: death) is done on the loop, between
    two of its callbacks, not at whatever bytecode the signal finds: after any record the handler
    queued behind a write of its own thread (see the module's docstring), never in the middle
    of a write. The loop's wakeup fd also wakes the main thread for a signal the kernel handed
    to another of its threads. `beneath` ({signum: handler}): where the handler in place only
    records before handing on to `handler` (a rank's start-up SIGTERM handler, kept through the
    hand-over to this loop), `handler` is the one handed on to and put back at the end."""
    if threading.current_thread() is not threading.main_thread():  # no handler can be set there
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    previous.update(beneath or {})
    heard = [signum for signum, handler in previous.items() if handler != signal.SIG_IGN]  # as `install`
    try:
        with anyio.open_signal_receiver(*heard) as arrivals:
            stops = StopSignals(record, early=False)
            stops.install()  # in front of the receiver's handlers, which only wake the loop
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(_hand_on_from_loop, arrivals, previous)
                    yield
                    tasks.cancel_scope.cancel()
            finally:
                stops.restore()
    finally:  # also after a cancelled or failed body: the receiver leaves the defaults behind
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


async def _hand_on_from_loop(arrivals, previous: dict) -> None:
    async for signum in arrivals:
        hand_on(previous.get(signum, signal.SIG_DFL), signum, None)
