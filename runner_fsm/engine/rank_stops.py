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
- in the hand-over itself (the handlers put back, the event loop starting, asyncio's own SIGINT
  handler not yet behind ours: a few ms) no handler of ours runs; a SIGINT there still reaches
  the rank as a `KeyboardInterrupt`, and only SIGINT raises that in a rank, so `missed` records
  it when it comes out of the loop with no request recorded. A SIGTERM there takes its default
  action unrecorded; its peers' records (or the launcher's SIGTERM to them) explain its end.

Before the log exists nothing can be recorded: a rank stopped then leaves no log, or a file with
no record (stopped inside `AuditLog`'s constructor). Replay names that rank alone (`missing_rank`,
`gap`) beside a peer's recorded stop; where no rank had its log yet there is nothing to replay.
"""

from __future__ import annotations

from typing import Callable

from runner_fsm.process.stop_signals import StopSignals


class StartupStops:
    """Records each stop request of one rank with the step it came at; counts what it recorded."""

    def __init__(self) -> None:
        self.recorded = 0  # stop requests recorded by this rank, whoever heard them
        self._audit = None
        self._step: Callable[[], int | None] = lambda: None  # before the replica exists: no step
        self._startup: StopSignals | None = None

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
        """The serving loop records from now on (`stops_on_loop`): the start-up handlers go."""
        if self._startup is not None:
            self._startup.restore()
            self._startup = None

    def missed(self, error: BaseException) -> None:
        """`error` ends the rank's loop: a `KeyboardInterrupt` with no request recorded came from a
        SIGINT that found no handler of ours (the hand-over): recorded now, before the rank goes."""
        if isinstance(error, KeyboardInterrupt) and not self.recorded:
            self.record("SIGINT", detail="heard as KeyboardInterrupt while the serving loop took over")
