"""A replay's progress on a terminal: one line on stderr, rewritten at most twice a second,
only when stderr is a terminal (quiet when piped or redirected), and only once the replay has
run for `AFTER_S` seconds (a short replay shows nothing)."""

from __future__ import annotations

import sys
import time

AFTER_S = 2.0
EVERY_S = 0.5


class TerminalProgress:
    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._next = self._start + AFTER_S
        self._first = self._last = None
        self._parts = 1
        self._shown = False

    def span(self, first: int | None, last: int | None, parts: int = 1) -> None:
        """The steps to judge; `parts` processes share them (this one reports its own range)."""
        self._first, self._last, self._parts = first, last, max(1, parts)

    def __call__(self, step: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + EVERY_S
        first, last = self._first, self._last
        share = f" (1 of {self._parts} processes)" if self._parts > 1 else ""
        if first is not None and last is not None and last > first:
            if self._parts > 1:
                last = first + (last - first) // self._parts
            done = min(1.0, max(0.0, (step - first) / (last - first)))
            text = f"replay: step {step:,} of {first:,}..{last:,} ({done:.0%}){share}, {now - self._start:.0f} s"
        else:
            text = f"replay: step {step:,}{share}, {now - self._start:.0f} s"
        self.stream.write("\r" + text.ljust(79)[:79])
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        """Clear the line (nothing when nothing was shown)."""
        if self._shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self._shown = False
