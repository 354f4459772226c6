"""A rank's stop requests on record from the moment its audit log exists, not only once it serves.

The serving loop records SIGINT and SIGTERM (`stop_signals.stops_on_loop`, inside `worker._serve`).
Before it, a rank opens its log and then loads its model and sets up the model's process groups
(`worker.build_runner`): 100 ms on a quiet box, longer under load. A Ctrl-C there found Python's
own SIGINT handler (a `KeyboardInterrupt`, no record), and each rank's log ended at its `job`
record: replay read both ranks as deaths (`unfinished` at step -1; 10 of 10 runs stopped 0-150 ms
after the first log appeared). So `StartupStops` records from the log's first moment:

- from just before the log is created until the loop takes over: chained handlers
  (`StopSignals`), heard by `signal_watch`'s thread too, since the main thread may wait in C
  there, then handed on as before (`KeyboardInterrupt`, SIGTERM's default action). Installed
  after the log was, they left a window: a rank descheduled on a loaded box between writing its
  `job` record and installing them met a Ctrl-C 40 ms later with Python's handler (2 runs in
  80). A request that arrives before the log exists is held: recorded as the log's first record
  after `job`, then handed on (the rank stops a few ms later than it would have);
- in the hand-over itself (our SIGINT handler put back so that asyncio installs its own, the
  event loop starting, `stops_on_loop` not yet in place: a few ms) no SIGINT handler of ours
  runs. `signal_watch`'s thread still hears a SIGINT there (its wakeup fd stays until the
  loop sets its own) and records it, whatever the main thread then does with it (asyncio's
  cancel, a `KeyboardInterrupt` met by the launcher's second SIGINT); `missed` records a
  `KeyboardInterrupt` that comes out of the loop with nothing recorded (only SIGINT raises that
  in a rank), for the microseconds after the loop took the wakeup fd. The SIGTERM handler
  stays until the loop's is in (it had the default action there: a rank killed unrecorded);
  the loop hands a SIGTERM on past it (`kept_through_hand_over`), so it is recorded once.

A Ctrl-C reaches a rank twice (the group's SIGINT, the launcher's relay a moment later): the
second's handler must not hand on in the middle of the first's record (`arrivals_held`).

Before `arm` (the process's start, the rendezvous) nothing can be recorded: a rank stopped then
leaves no log. Replay names that rank alone (`missing_rank`) beside a peer's recorded stop; where
no rank had its log yet there is nothing to replay.
"""

from __future__ import annotations

import collections
import signal
from typing import Callable

from runner_fsm.process.signal_watch import WATCH
from runner_fsm.process.stop_signals import STOP_SIGNALS, StopSignals, arrivals_held, hand_on, hand_on_in_order


class StartupStops:
    """Records each stop request of one rank with the step it came at; counts what it recorded."""

    def __init__(self) -> None:
        self.recorded = 0  # stop requests recorded (or held for the log) by this rank, whoever heard them
        self._audit = None
        self._pending: collections.deque = collections.deque()  # (name, detail) not written yet
        self._step: Callable[[], int | None] = lambda: None  # before the replica exists: no step
        self._startup: _HeldUntilLogged | None = None
        self._kept: _HeldUntilLogged | None = None  # its SIGTERM handler, through the hand-over
        self._watching: list = []  # the watch's subscriptions through the hand-over

    @property
    def logged(self) -> bool:
        return self._audit is not None

    def record(self, name: str, detail: str = "") -> None:
        """Safe in a signal handler and from the watch thread (`AuditLog.stop`). Before the log
        exists the request waits for it (`log_opened`)."""
        self._pending.append((name, detail))  # first: a request counted is never one not pending
        self.recorded += 1
        if self._audit is not None:  # else `log_opened` writes it; both may drain: each pops its own
            self._write_pending()

    def _write_pending(self) -> None:
        # a stop arriving meanwhile (the launcher's relay of the same Ctrl-C) must not be handed on
        # (KeyboardInterrupt) in the middle of this write: held until it is done (`arrivals_held`)
        with arrivals_held() as held:
            while True:
                try:
                    name, detail = self._pending.popleft()
                except IndexError:
                    break
                self._audit.stop(self._step(), "signal", name, detail=detail)
        hand_on_in_order(held, None)

    def arm(self) -> None:
        """From now on a stop request is recorded, held until the log exists (`log_opened`)."""
        self._startup = _HeldUntilLogged(self)
        self._startup.install()

    def log_opened(self, audit) -> None:
        """The rank's log exists: what was held is written, then handed on (a held SIGINT raises
        `KeyboardInterrupt` here, as it would have where it arrived)."""
        self._audit = audit
        self._write_pending()
        if self._startup is not None:
            self._startup.release()

    def steps_of(self, step: Callable[[], int | None]) -> None:
        """Stops are recorded at the step `step()` names (the replica's, once it exists)."""
        self._step = step

    def hand_over(self) -> None:
        """The serving loop is about to record (`stops_on_loop`): the start-up's SIGINT handler goes
        (asyncio installs its own only over Python's), its SIGTERM handler stays until the loop's
        is in (`kept_through_hand_over`), the watch until `loop_took_over`. A request still held
        (the log never opened) is handed on now."""
        startup, self._startup = self._startup, None
        if startup is None:
            return
        # subscribed before the handlers go, so that the watch never stops between the two
        self._watching = [WATCH.subscribe(signum, self._heard_in_hand_over) for signum in STOP_SIGNALS]
        if self.logged:  # else it would hold a SIGTERM for a log that never comes
            startup.restore(keep=(signal.SIGTERM,))
            self._kept = startup
        else:
            startup.restore()
        startup.release()

    def kept_through_hand_over(self) -> dict:
        """{signum: handler} for `stops_on_loop(beneath=...)`: the SIGTERM handler kept through the
        hand-over records, then hands on to this one; the loop's handlers hand on to it directly."""
        kept = self._kept
        if kept is None or signal.getsignal(signal.SIGTERM) != kept._handle:
            return {}
        return {signal.SIGTERM: kept._handed_to.get(signal.SIGTERM, signal.SIG_DFL)}

    def loop_took_over(self) -> None:
        """The loop's handlers record now (or the rank is leaving): the watch and the kept SIGTERM
        handler go too (put back only where still installed: the loop's stay)."""
        for subscription in self._watching:
            WATCH.unsubscribe(subscription)
        self._watching = []
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.restore()

    def _heard_in_hand_over(self, signum: int) -> None:
        """From the watch thread, for an arrival no handler of ours claimed: one our start-up
        handler caught as the handlers went, or one it never saw. Recorded if none is yet."""
        if not self.recorded:
            self.record(signal.Signals(signum).name, detail="heard while the serving loop took over")

    def missed(self, error: BaseException) -> None:
        """`error` ends the rank's loop: a `KeyboardInterrupt` with no request recorded came from a
        SIGINT that found no handler of ours (the hand-over): recorded now, before the rank goes.

        The launcher's relay of the same Ctrl-C comes a millisecond behind the group's SIGINT, and
        here Python's own SIGINT handler is in place: landing in this write before it held
        arrivals, it raised `KeyboardInterrupt` in the middle, and the request, counted but not
        written, was lost (the watch, seeing it counted, stayed silent; CI: one rank of 20 runs
        of tests/test_stop_race.py with no stop record). So the write is taken up again until it
        is done, arrivals held; what was held is handed on after it."""
        if not isinstance(error, KeyboardInterrupt):
            return
        while True:
            try:
                with arrivals_held() as held:
                    if not self.recorded:
                        self.record("SIGINT", detail="heard as KeyboardInterrupt while the serving loop took over")
                    elif self._pending and self._audit is not None:  # counted, its write cut short
                        self._write_pending()
                break
            except KeyboardInterrupt:  # that relay, before the hold: recorded on the next pass
                continue
        hand_on_in_order(held, None)


class _HeldUntilLogged(StopSignals):
    """`StopSignals` whose arrivals before the log exists are held: recorded (in `pending`), and
    handed on by `release` once the log has them, not at once (that would stop the rank before
    its log could)."""

    def __init__(self, stops: StartupStops):
        super().__init__(stops.record)
        self._stops = stops
        self._held: list[int] = []
        self._handed_to: dict[int, object] = {}  # the previous handlers, kept past `restore`

    def install(self) -> bool:
        installed = super().install()
        self._handed_to = dict(self._previous)
        return installed

    def _handle(self, signum: int, frame) -> None:
        if self._stops.logged:
            super()._handle(signum, frame)
            return
        if not WATCH.settle(self._subscriptions.get(signum)):  # not recorded from the watch yet
            self._stops.record(signal.Signals(signum).name)
        self._held.append(signum)

    def release(self) -> None:
        """Hand on what was held, in order (the first that stops the process ends it)."""
        held, self._held = self._held, []
        for signum in held:
            hand_on(self._handed_to.get(signum, signal.SIG_DFL), signum, None)
