"""A rank's stop requests on record from the moment its audit log exists, not only once it serves.

The serving loop records SIGINT and SIGTERM (`stop_signals.stops_on_loop`, inside `worker._serve`).
Before it, a rank opens its log and then loads its model and sets up the model's process groups
(`worker.build_runner`): 100 ms on a quiet box, longer under load. A Ctrl-C there found Python's
own SIGINT handler (a `KeyboardInterrupt`, no record), and each rank's log ended at its `job`
record: replay read both ranks as deaths (`unfinished` at step -1; 10 of 10 runs stopped 0-150 ms
after the first log appeared). So `StartupStops` records from the log's first moment:

- from the log's creation until the loop takes over: chained handlers (`StopSignals`), heard by
  `signal_watch`'s thread too, since the main thread waits in C there (a gloo `new_group`, the
  model's load), then handed on as before (`KeyboardInterrupt`, SIGTERM's default action);
- in the hand-over itself (our handlers put back so that asyncio installs its own SIGINT
  handler, the event loop starting, `stops_on_loop` not yet in place: a few ms) no handler of
  ours runs. `signal_watch`'s thread still hears a SIGINT there (its wakeup fd stays until the
  loop sets its own) and records it, whatever the main thread then does with it (asyncio's
  cancel, a `KeyboardInterrupt` met by the launcher's second SIGINT); `missed` records a
  `KeyboardInterrupt` that comes out of the loop with nothing recorded (only SIGINT raises that
  in a rank), for the microseconds after the loop took the wakeup fd. A SIGTERM there takes its
  default action at once, unrecorded: its peers' records of the same stop explain its end.

Before the log exists nothing can be recorded: a rank stopped then leaves no log, or a file with
no record (stopped inside `AuditLog`'s constructor). Replay names that rank alone (`missing_rank`,
`gap`) beside a peer's recorded stop; where no rank had its log yet there is nothing to replay.
"""

from __future__ import annotations

import signal
from typing import Callable

from runner_fsm.process.signal_watch import WATCH
from runner_fsm.process.stop_signals import STOP_SIGNALS, StopSignals


class StartupStops:
    """Records each stop request of one rank with the step it came at; counts what it recorded."""

    def __init__(self) -> None:
        self.recorded = 0  # stop requests recorded by this rank, whoever heard them
        self._audit = None
        self._step: Callable[[], int | None] = lambda: None  # before the replica exists: no step
        self._startup: StopSignals | None = None
        self._watching: list = []  # the watch's subscriptions through the hand-over

    def record(self, name: str, detail: str = "") -> None:
        """Safe in a signal handler and from the watch thread (`AuditLog.stop`)."""
        if self._audit is None:
            return
        self.recorded += 1
        self._audit.stop(self._step(), "signal", name, detail=detail)

    def log_opened(self, audit) -> None:
        """The rank's log exists: from now on a stop request is recorded (until `hand_over`)."""
        self._audit = audit
        self._startup = StopSignals(self.record)
        self._startup.install()

    def steps_of(self, step: Callable[[], int | None]) -> None:
        """Stops are recorded at the step `step()` names (the replica's, once it exists)."""
        self._step = step

    def hand_over(self) -> None:
        """The serving loop is about to record (`stops_on_loop`): the start-up handlers go, the
        watch stays until `loop_took_over`."""
        if self._startup is not None:
            # subscribed before the handlers go, so that the watch never stops between the two
            self._watching = [WATCH.subscribe(signum, self._heard_in_hand_over) for signum in STOP_SIGNALS]
            self._startup.restore()
            self._startup = None

    def loop_took_over(self) -> None:
        """The loop's handlers record now (or the rank is leaving): the watch goes too."""
        for subscription in self._watching:
            WATCH.unsubscribe(subscription)
        self._watching = []

    def _heard_in_hand_over(self, signum: int) -> None:
        """From the watch thread, for an arrival no handler of ours claimed: one our start-up
        handler caught as the handlers went, or one it never saw. Recorded if none is yet."""
        if not self.recorded:
            self.record(signal.Signals(signum).name, detail="heard while the serving loop took over")

    def missed(self, error: BaseException) -> None:
        """`error` ends the rank's loop: a `KeyboardInterrupt` with no request recorded came from a
        SIGINT that found no handler of ours (the hand-over): recorded now, before the rank goes."""
        if isinstance(error, KeyboardInterrupt) and not self.recorded:
            self.record("SIGINT", detail="heard as KeyboardInterrupt while the serving loop took over")
