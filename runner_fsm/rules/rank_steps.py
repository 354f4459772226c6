"""Reading a run step by step: every rank's steps merged by step id.

- `RankStep`: one rank's step reduced to what its peers must match. The scanner fills a
  `StepBuilder` while it reads a step, then seals it: the collectives as a signature (per
  group, the (op, phase, shapes) it issued in order), the first `pg_seq` per group, which
  collectives never got their `done`, the agreed states, the output digest, the fault and the
  step kind. Equal signatures are one shared object, so comparing ranks is cheap in the common
  case and a batch of steps pickles small.
- `StepMerger`: each rank's log is ordered by step, so a k-way merge on the step id sees every
  rank's summary of step S together while holding nothing older: memory is bounded by the
  number of ranks, not by the length of the run.

The rank files themselves, their coordinates and groups: `rules.ranks`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping


def freeze(value):
    """Lists to tuples, recursively: shapes become hashable sequence keys."""
    return tuple(map(freeze, value)) if isinstance(value, list) else value


class StepBuilder:
    """The step a scanner is reading; sealed into a `RankStep` when the next one starts."""

    __slots__ = ("step", "line", "keys", "first_pg", "open", "agreed", "fault", "kind", "drafted", "output",
                 "faulted", "aborted", "resumed", "digest", "decisions", "proposed", "gate", "captured")

    def __init__(self, step: int, line: int, resumed: bool = False, captured: frozenset = frozenset()):
        self.step, self.line = step, line
        self.captured = captured  # the graph sizes this rank had captured (`BufferTracker.captured`)
        self.resumed = resumed  # the log jumped to this step (a seek, a rotation gap)
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
        self.faulted = False  # its state machine took the `faulted` edge in this step
        self.aborted = False  # it sent a non-ok status to a DP agreement: the step is aborted
        self.digest: int | None = None  # its decision digest (`audit.decisions`), on its `finish`
        self.decisions: dict | None = None  # its decisions as known so far (None: none logged)
        # (num_tokens, graph_mode) it sent to the target agreement, and its largest graph captured
        self.proposed: tuple | None = None
        self.gate: int | None = None  # the drafter steps its gate let run (`decisions.GATE_EVENT`), when logged

    def open_collective(self) -> tuple | None:
        """The last collective of the step still awaiting its `done`."""
        return max((p for pending in self.open.values() for p in pending), key=lambda p: p[5], default=None)

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
                        self.fault, self.kind, self.drafted, ended, hung, timed_out, self.output,
                        self.faulted, self.aborted, self.resumed,
                        (self.digest, self.decisions, self.proposed, self.gate, self.captured))


class RankStep:
    """What one rank did in one step, as far as its peers must match it; read-only."""

    __slots__ = ("rank", "step", "line", "signature", "first_pg", "open", "agreed", "fault", "kind",
                 "drafted", "ended", "hang", "hang_timed_out", "output", "faulted", "aborted", "resumed",
                 "decided")

    def __init__(self, rank, step, line, signature, first_pg, open_, agreed, fault, kind, drafted,
                 ended, hang, hang_timed_out, output=None, faulted=False, aborted=False, resumed=False,
                 decided=(None, None, None, None, frozenset())):
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
        self.faulted = faulted  # its transitions show it faulted in this step
        self.aborted = aborted  # it sent a non-ok status to a DP agreement in this step
        self.resumed = resumed  # its log jumped to this step (a seek, steps rotated away before it)
        # what `rules.consensus` compares across the replica's ranks: (decision digest or None,
        # decisions as known or None, (num_tokens, graph_mode, largest graph captured) of its
        # target agreement or None, drafter steps its gate let run or None, graph sizes it had captured)
        self.decided = decided

    def __reduce__(self):
        return (RankStep, (self.rank, self.step, self.line, self.signature, self.first_pg, self.open,
                           self.agreed, self.fault, self.kind, self.drafted, self.ended, self.hang,
                           self.hang_timed_out, self.output, self.faulted, self.aborted, self.resumed,
                           self.decided))

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


class Whereabouts:
    """Where each rank's log is while steps are merged: what `hang` and `missing_replica` cite."""

    def __init__(self) -> None:
        self.last_step: dict[int, int] = {}  # rank -> last step merged so far
        self.exhausted: set[int] = set()  # ranks whose log has no further step

    def whereabouts(self, rank: int, step: int) -> str:
        """Why `rank` has no record at `step`, in words."""
        if rank not in self.last_step and rank in self.exhausted:
            return "its log holds no step at all"
        if rank in self.exhausted and self.last_step.get(rank, step) < step:
            return f"its log ends at step {self.last_step[rank]}"
        return "it skipped to a later step"


class StepMerger(Whereabouts):
    """Yields (step, {rank: RankStep}) in step order; knows where absent ranks are."""

    def __init__(self, streams: Mapping[int, Iterator[RankStep]], *,
                 ended_before: Mapping[int, int | None] = {}, cut: set[int] = frozenset(),
                 rotated: Mapping[int, list[tuple[int, int]]] = {}):
        """`ended_before`: ranks whose log ended before this range, with their last step (None
        when it holds no step at all);
        `cut`: filled by the streams with the ranks they stopped at the end of the range
        (those logs go on, so such a rank is not at its end);
        `rotated`: per rank, the (first, last) steps its capped log no longer holds."""
        super().__init__()
        self._streams = dict(streams)
        self._rotated = rotated  # lists a stream may add to (a segment deleted while it is read)
        self._cut = cut
        self.exhausted.update(ended_before)
        self.last_step.update((rank, step) for rank, step in ended_before.items() if step is not None)
        self._heap: list[tuple[int, int, RankStep]] = []
        for rank, stream in self._streams.items():
            self._advance(rank, stream)

    def blind(self, rank: int, step: int) -> bool:
        """Whether `rank`'s log no longer holds `step` (rotated away): nothing is known of it there."""
        spans = self._rotated.get(rank)
        return bool(spans) and any(first <= step <= last for first, last in spans)

    def _advance(self, rank: int, stream: Iterator[RankStep]) -> None:
        following = next(stream, None)
        if following is None:
            if rank not in self._cut:
                self.exhausted.add(rank)
        else:
            heapq.heappush(self._heap, (following.step, rank, following))

    def __iter__(self) -> Iterator[tuple[int, dict[int, RankStep]]]:
        heap = self._heap
        while heap:
            step = heap[0][0]
            present: dict[int, RankStep] = {}
            while heap and heap[0][0] == step:
                _, rank, summary = heapq.heappop(heap)
                present[rank] = summary
                self.last_step[rank] = step
                self._advance(rank, self._streams[rank])
            yield step, present
