"""Reading a run: its rank files, the DP x PCP layout, the process groups, and every rank's
steps merged by step id.

- `discover`: each `rank-<global_rank>.jsonl` with its coordinates, taken from its own records
  (`dp_rank`, `pcp_rank`), and the job's shape its first record declares (`audit.shape`); a
  file with no readable record (killed before its first line was complete) gets them from its
  global rank and the PCP size of the shape, or, in logs written without one, of its siblings.
- `Groups`: which ranks must issue the same collectives. The instance of a group a rank is in
  follows from the layout: `dp` is one group per PCP rank over the replicas (the DP
  agreement's), `pcp` one group per replica over its PCP ranks, anything else (`expert`, ...)
  one group over every rank.
- `RankStep`: one rank's step reduced to what its peers must match. The scanner fills a
  `StepBuilder` while it reads a step, then seals it: the collectives as a signature (per
  group, the (op, phase, shapes) it issued in order), the first `pg_seq` per group, which
  collectives never got their `done`, the agreed states, the output digest, the fault and the
  step kind. Equal signatures are one shared object, so comparing ranks is cheap in the common
  case and a batch of steps pickles small.
- `StepMerger`: each rank's log is ordered by step, so a k-way merge on the step id sees every
  rank's summary of step S together while holding nothing older: memory is bounded by the
  number of ranks, not by the length of the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path
import dataclasses
import heapq
import os
import re

import orjson

from runner_fsm.audit.order import last_phase
from runner_fsm.audit.report import ReplayInputError
from runner_fsm.audit.shape import JOB_EVENT, JobShape


RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
_PROBE_LINES = 64  # enough to get past a damaged first line, few enough to stay instant


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One process of the run: its global rank, its coordinates and its log file."""

    global_rank: int
    dp_rank: int
    pcp_rank: int
    path: Path
    shape: JobShape | None = None  # the job as this log's first record declares it
    # K, the drafter's tokens per step, where the `job` record names it (`num_speculative_tokens`,
    # the vLLM worker's): it bounds the phases of a step (`audit.order`, rule 0).
    spec_tokens: int | None = None

    @property
    def file(self) -> str:
        return self.path.name


def discover(run_dir: str | os.PathLike[str]) -> list[RankInfo]:
    """Every rank file of `run_dir` with its coordinates; `ReplayInputError` if none can be read."""
    directory = Path(run_dir)
    if not directory.exists():
        raise ReplayInputError(f"run directory {directory} does not exist")
    if not directory.is_dir():
        raise ReplayInputError(f"{directory} is not a directory (expected a run directory of rank-*.jsonl)")
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise ReplayInputError(f"cannot list run directory {directory}: {err}") from err
    ranked = sorted((int(m[1]), directory / name) for name in names if (m := RANK_FILE.match(name)))
    if not ranked:
        raise ReplayInputError(f"no rank-<global_rank>.jsonl files in {directory}; is it a run directory?")
    probed = {rank: _probe(path) for rank, path in ranked}
    shape = next((shape for _, shape, _ in probed.values() if shape is not None), None)
    pcp_size = shape.pcp_size if shape is not None else \
        1 + max((coords[1] for coords, _, _ in probed.values() if coords), default=0)
    return [RankInfo(rank, *(probed[rank][0] or divmod(rank, pcp_size)), path, probed[rank][1], probed[rank][2])
            for rank, path in ranked]


def _probe(path: Path) -> tuple[tuple[int, int] | None, JobShape | None, int | None]:
    """(dp_rank, pcp_rank) from the first record that has both (or None), the job's shape
    when the first line is a `job` record (or None: a log of a writer that logs no shape), and
    the drafter's K when that record names it."""
    coords = shape = spec_tokens = None
    try:
        with open(path, "rb") as lines:
            for line_no, raw in enumerate(islice(lines, _PROBE_LINES), 1):
                try:
                    record = orjson.loads(raw)
                    dp_rank, pcp_rank = record["dp_rank"], record["pcp_rank"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    continue
                if line_no == 1 and record.get("event") == JOB_EVENT:
                    try:
                        shape = JobShape.from_record(record)
                    except ValueError as err:
                        raise ReplayInputError(f"{path}:1: unreadable job shape: {err}") from None
                    k = record.get("num_speculative_tokens")
                    spec_tokens = k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else None
                if isinstance(dp_rank, int) and isinstance(pcp_rank, int):
                    coords = dp_rank, pcp_rank
                    break
    except OSError as err:
        raise ReplayInputError(f"cannot read {path}: {err}") from err
    return coords, shape, spec_tokens


def layout_of(infos: list[RankInfo]) -> tuple[int, int]:
    """(replicas, pcp_size): as the job's shape declares them, else as the rank files show them."""
    shape = next((i.shape for i in infos if i.shape is not None), None)
    if shape is not None:
        return shape.dp_size, shape.pcp_size
    return 1 + max(i.dp_rank for i in infos), 1 + max(i.pcp_rank for i in infos)


def job_last_phase(infos) -> int | None:
    """The last phase of a step (`audit.order.last_phase`), when every log names the same
    drafter K; None (unknown) otherwise."""
    ks = {info.spec_tokens for info in infos}
    return last_phase(ks.pop()) if len(ks) == 1 and None not in ks else None


def instance_key(group: str, info: RankInfo) -> tuple:
    if group == "dp":
        return ("dp", info.pcp_rank)
    if group == "pcp":
        return ("pcp", info.dp_rank)
    return (group,)


class Groups:
    """Group instances of a run, memoised: `instance(group, rank)`, `members(key)`."""

    def __init__(self, infos: list[RankInfo]):
        self.infos = {info.global_rank: info for info in infos}
        self._instance: dict[tuple[str, int], tuple] = {}
        self._members: dict[tuple, tuple[int, ...]] = {}

    def instance(self, group: str, rank: int) -> tuple:
        key = self._instance.get((group, rank))
        if key is None:
            key = self._instance[(group, rank)] = instance_key(group, self.infos[rank])
        return key

    def members(self, group: str, key: tuple) -> tuple[int, ...]:
        found = self._members.get(key)
        if found is None:
            found = self._members[key] = tuple(r for r in sorted(self.infos) if self.instance(group, r) == key)
        return found

    def replica(self, rank: int) -> int:
        return self.infos[rank].dp_rank

    @property
    def last_phase(self) -> int | None:
        return job_last_phase(self.infos.values())

    def replicas_text(self, ranks) -> str:
        """'replica 1 (ranks 2, 3)' for a set of ranks, grouped by replica."""
        by_replica: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_replica.setdefault(self.replica(rank), []).append(rank)
        return "; ".join(f"replica {d} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                         for d, rs in sorted(by_replica.items()))


def freeze(value):
    """Lists to tuples, recursively: shapes become hashable sequence keys."""
    return tuple(map(freeze, value)) if isinstance(value, list) else value


class StepBuilder:
    """The step a scanner is reading; sealed into a `RankStep` when the next one starts."""

    __slots__ = ("step", "line", "keys", "first_pg", "open", "agreed", "fault", "kind", "drafted", "output",
                 "faulted", "aborted")

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
        self.faulted = False  # its state machine took the `faulted` edge in this step
        self.aborted = False  # it sent a non-ok status to a DP agreement: the step is aborted

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
                        self.faulted, self.aborted)


class RankStep:
    """What one rank did in one step, as far as its peers must match it; read-only."""

    __slots__ = ("rank", "step", "line", "signature", "first_pg", "open", "agreed", "fault", "kind",
                 "drafted", "ended", "hang", "hang_timed_out", "output", "faulted", "aborted")

    def __init__(self, rank, step, line, signature, first_pg, open_, agreed, fault, kind, drafted,
                 ended, hang, hang_timed_out, output=None, faulted=False, aborted=False):
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

    def __reduce__(self):
        return (RankStep, (self.rank, self.step, self.line, self.signature, self.first_pg, self.open,
                           self.agreed, self.fault, self.kind, self.drafted, self.ended, self.hang,
                           self.hang_timed_out, self.output, self.faulted, self.aborted))

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
                 ended_before: Mapping[int, int | None] = {}, cut: set[int] = frozenset()):
        """`ended_before`: ranks whose log ended before this range, with their last step (None
        when it holds no step at all);
        `cut`: filled by the streams with the ranks they stopped at the end of the range
        (those logs go on, so such a rank is not at its end)."""
        super().__init__()
        self._streams = dict(streams)
        self._cut = cut
        self.exhausted.update(ended_before)
        self.last_step.update((rank, step) for rank, step in ended_before.items() if step is not None)
        self._heap: list[tuple[int, int, RankStep]] = []
        for rank, stream in self._streams.items():
            self._advance(rank, stream)

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
