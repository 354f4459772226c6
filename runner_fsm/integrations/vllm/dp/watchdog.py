"""`collective_timeout_s` for vLLM: a stuck forward or DP collective ends every rank, naming why.

vLLM's gloo collectives wait without end when a peer never joins (an idle replica that skipped
its dummy forward or the drafter's dummy run): the job just hangs. The worker marks where it
is (`Heartbeat`, the same positions in the job's c10d store that the embedded engine keeps) and
this thread times every forward and DP collective. One that overruns the timeout is reported
with every rank's last position (`heartbeat.describe()` names the culprit replica and step),
published in the store for the peers (which may be stuck outside the worker, in vLLM's engine
loop), logged as a `fault`, and the process exits: a thread blocked in gloo cannot be
interrupted. Peers that see the published abort exit with the same message.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Callable

from runner_fsm.agree.heartbeat import describe_positions
from runner_fsm.errors import CollectiveTimeout

ABORT_KEY = "runner_fsm/abort"
EXIT_CODE = 70  # EX_SOFTWARE: the run was stopped by its own check


class Watchdog:
    """Times what the worker is inside of; `fire` reports and ends the process."""

    def __init__(self, heartbeat, timeout_s: float, *, dp_rank: int,
                 on_fault: Callable[[int | None, BaseException], None] | None = None,
                 poll_s: float = 0.25, linger_s: float = 3.0):
        self.heartbeat, self.timeout_s, self.dp_rank = heartbeat, float(timeout_s), dp_rank
        self.on_fault, self.poll_s, self.linger_s = on_fault, poll_s, linger_s
        self._inside: tuple[int, int, str, float] | None = None  # step, phase, what, since
        self._last_step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-fsm-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def enter(self, step: int, phase: int, what: str) -> None:
        self._last_step = step
        self.heartbeat.beat(step, phase, what)
        self._inside = (step, phase, what, time.monotonic())

    def leave(self, step: int, phase: int) -> None:
        self._inside = None
        self.heartbeat.beat(step, phase, "")

    def beat(self, step: int, phase: int, what: str) -> None:
        """The `AgreementTap` position callback: a non-empty `what` is a collective entered."""
        self.enter(step, phase, what) if what else self.leave(step, phase)

    # -- the thread

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            inside = self._inside
            if inside is not None and time.monotonic() - inside[3] > self.timeout_s:
                step, phase, what, _ = inside
                message = (f"replica {self.dp_rank}: {what} at step {step} did not finish within"
                           f" {self.timeout_s:g} s; {self.describe()}")
                self._publish(message)
                self.fire(step, message)
            published = self._published()
            if published is not None:
                self.fire(self._last_step, f"replica {self.dp_rank} stops: a peer timed out: {published}")

    def describe(self) -> str:
        """The heartbeat's sentence, led by `culprit: replica R at step S` (R's last position)."""
        try:
            positions = self.heartbeat.positions()
        except Exception:  # noqa: BLE001 - the heartbeat says why in its own words
            return self.heartbeat.describe()
        sentence = describe_positions(positions, self.heartbeat.layout,
                                      last_phase=getattr(self.heartbeat, "last_phase", None))
        named = re.match(r"culprit: replica ([\d, ]+)", sentence)
        if named is None:
            return sentence
        replicas = [int(r) for r in named.group(1).replace(" ", "").split(",") if r]
        steps = {r: p.step for p in positions.values() for r in [self.heartbeat.layout.coords(p.rank)[0]]
                 if r in replicas}
        lead = "; ".join(f"culprit: replica {r} at step {steps[r]}" if r in steps
                         else f"culprit: replica {r} (no position)" for r in replicas)
        return f"{lead} ({sentence})"

    def _publish(self, message: str) -> None:
        try:
            self.heartbeat.store.set(ABORT_KEY, message.encode())
        except Exception:  # the store is rank 0's: it may be gone already
            pass

    def _published(self) -> str | None:
        try:
            store = self.heartbeat.store
            return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None
        except Exception:
            return None

    def fire(self, step: int | None, message: str) -> None:
        error = CollectiveTimeout(message)
        if self.on_fault is not None:
            try:
                self.on_fault(step, error)
            except Exception:  # reporting must not keep a hung process alive
                pass
        print(f"runner_fsm watchdog: CollectiveTimeout: {message}", file=sys.stderr, flush=True)
        time.sleep(self.linger_s)  # peers may still read the positions in rank 0's store
        os._exit(EXIT_CODE)
