"""One rank's step, reduced to what its peers must match: `RankStep`.

The scanner fills a `StepBuilder` while it reads a step, then seals it into a compact
`RankStep`: the collectives as a signature (per group, the (op, phase, shapes) it issued in
order), the first `pg_seq` per group, which collectives never got their `done`, the agreed
states, the fault and the step kind. Equal signatures are one shared object, so comparing
ranks is cheap in the common case and a batch of steps pickles small (see `parallel`).
"""

from __future__ import annotations


class StepBuilder:
    """The step a scanner is reading; sealed into a `RankStep` when the next one starts."""

    __slots__ = ("step", "line", "keys", "first_pg", "open", "agreed", "fault", "kind", "drafted", "output")

    def __init__(self, step: int, line: int):
        self.step, self.line = step, line
        self.keys: dict[str, list[tuple]] = {}  # group -> (op, phase, shapes) in issue order
        self.first_pg: dict[str, int] = {}  # group -> pg_seq of its first collective this step
        # group -> collectives awaiting `done`, as plain tuples (one is made per collective of
        # the run): (group, index in the group's keys, op, phase, pg_seq, line, sent), where
        # `sent` is a DP agreement's own column (LocalDispatch) when the writer logs it.
        self.open: dict[str, list[tuple]] = {}
        self.agreed: list[tuple[int, dict]] = []  # (phase, agreed DPSyncState) as logged on `done`
        self.fault: tuple[str, str] | None = None  # (error, message) of the step's first fault
        self.kind: str | None = None  # prefill | decode | idle, from the step's transition
        self.drafted = False
        self.output: int | None = None  # digest of what this rank sampled, when logged

    def seal(self, rank: int, interned: dict, *, ended=False, hang: tuple | None = None,
             timed_out=False) -> RankStep:
        signature = tuple((group, tuple(keys)) for group, keys in self.keys.items())
        try:
            signature = interned.setdefault(signature, signature)
        except TypeError:  # a malformed record logged an op or phase that is a list or object
            signature = tuple((group, tuple(tuple(map(repr, key)) for key in keys)) for group, keys in signature)
        first_pg = tuple(self.first_pg[group] for group in self.keys)
        open_ = {group: tuple(p[1] for p in pending) for group, pending in self.open.items() if pending}
        hung = (hang[0], hang[1], hang[4]) if hang is not None else None
        return RankStep(rank, self.step, self.line, signature, first_pg, open_ or None, self.agreed,
                        self.fault, self.kind, self.drafted, ended, hung, timed_out, self.output)


class RankStep:
    """What one rank did in one step, as far as its peers must match it; read-only."""

    __slots__ = ("rank", "step", "line", "signature", "first_pg", "open", "agreed", "fault", "kind",
                 "drafted", "ended", "hang", "hang_timed_out", "output")

    def __init__(self, rank, step, line, signature, first_pg, open_, agreed, fault, kind, drafted,
                 ended, hang, hang_timed_out, output=None):
        self.rank, self.step, self.line = rank, step, line
        self.signature = signature  # ((group, ((op, phase, shapes), ...)), ...) in issue order
        self.first_pg = first_pg  # per group of the signature: pg_seq of its first collective
        self.open = open_  # None, or group -> indices of collectives with no `done`
        self.agreed = agreed
        self.fault, self.kind, self.drafted = fault, kind, drafted
        self.ended = ended  # the rank's log ends in this step
        self.hang = hang  # None, or (group, index, pg_seq) of the collective it stopped in
        self.hang_timed_out = hang_timed_out
        self.output = output  # digest of the tokens this rank sampled, or None

    def __reduce__(self):
        return (RankStep, (self.rank, self.step, self.line, self.signature, self.first_pg, self.open,
                           self.agreed, self.fault, self.kind, self.drafted, self.ended, self.hang,
                           self.hang_timed_out, self.output))

    def keys(self, group: str) -> tuple:
        for name, keys in self.signature:
            if name == group:
                return keys
        return ()

    def first_pg_of(self, group: str):
        for (name, _), pg_seq in zip(self.signature, self.first_pg):
            if name == group:
                return pg_seq
        return None

    def done(self, group: str, index: int) -> bool:
        return self.open is None or index not in self.open.get(group, ())

    def agreed_any(self, group: str = "dp") -> bool:
        """Did any collective of `group` reach `done` in this step?"""
        return len(self.keys(group)) > len(self.open.get(group, ()) if self.open else ())
