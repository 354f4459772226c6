"""The transition rule (`illegal_transition`), the one rule of `checks` that needs a rank's
history: each logged transition follows from the table the runtime machine is built from and
chains onto the previous one (`init` first). `ok` reaches the table's destination; `error`
and `cancelled` leave the replica where it was or at the destination; `refused` leaves the
state unchanged, and the table indeed has no such edge. Re-exported by `checks`.
"""

from __future__ import annotations

from typing import Callable

from runner_fsm.states import State, next_state

OUTCOMES = ("ok", "error", "refused", "cancelled")
_MISSING = object()


class TransitionChecker:
    """Tracks one rank's state; `report(kind, detail, line=...)` receives each violation."""

    def __init__(self, report: Callable[..., None]):
        self._report = report
        self.state: str | None = State.INIT.value  # None: unknown (a scan resumed mid-file)
        self._also = None  # after a record the table contradicts, the state the table meant
        self._table: dict[tuple[str, str], str | None] = {}  # (src, trigger) -> dst, memoised

    def _dest(self, src: str, trigger: str) -> str | None:
        dest = self._table.get((src, trigger), _MISSING)
        if dest is _MISSING:
            found = next_state(src, trigger) if isinstance(src, str) and isinstance(trigger, str) else None
            dest = self._table[(src, trigger)] = found.value if found is not None else None
        return dest

    def check(self, trigger: str, src: str, dst: str, outcome: str, line: int) -> None:
        if outcome == "ok" and src == self.state and self._table.get((src, trigger)) == dst:
            self.state, self._also = dst, None  # the common case, without building anything
            return
        problem = self._problem(trigger, src, dst, outcome)
        if problem is not None:
            self._report("illegal_transition", f"{trigger!r} {src} -> {dst} ({outcome}): {problem}", line=line)
        # Follow the log, but let the next record chain onto the table's state as well: a wrong
        # dst is then reported once, whichever of the two the replica really reached.
        self._also = self._dest(src, trigger) if problem is not None else None
        self.state = dst

    def _problem(self, trigger, src, dst, outcome) -> str | None:
        if src is None and self.state is None:
            return None  # read after a jump in the log: where it came from is not known
        if self.state is not None and src != self.state and src != self._also:
            return f"src {src!r} does not chain onto the previous dst {self.state!r}"
        dest = self._dest(src, trigger)
        if outcome == "ok":
            if dest is None:
                return f"the table has no {trigger!r} edge from {src!r}"
            return None if dst == dest else f"the table leads to {dest!r}"
        if outcome in ("error", "cancelled"):
            if dst == src or (dest is not None and dst == dest):
                return None
            expected = f"{src!r} or {dest!r}" if dest is not None else f"{src!r}"
            return f"a failed trigger leaves the replica in {expected}"
        if outcome == "refused":
            if dst != src:
                return "a refused trigger must leave the state unchanged"
            return None if dest is None else f"refused although the table allows it (to {dest!r})"
        return f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}"
