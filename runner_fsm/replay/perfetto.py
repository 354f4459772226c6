"""`runner-fsm replay RUN_DIR --perfetto TRACE.json`: the run as a Chrome trace-event file.

Opens in Perfetto (ui.perfetto.dev, "Open trace file") and chrome://tracing. One process per
replica, one thread per rank (its global rank). Per rank:
- a slice per state it worked in (`prefill`, `decode`, `idle_dummy`, `draft_sync`, `capturing`):
  from the first record after the previous transition to the record of the transition into
  that state, which the runner writes once the state's work is done (a failed one ends at its
  `error` record and says so);
- inside it, a slice per collective from `enqueue` to `done` (args: step, phase, pg_seq and what
  the record carried: `sent`, `agreed`, `rows`...); one never done ends with its state slice;
- instant events for the rank's `fault` records and for every replay finding (kind, detail);
- flow arrows joining the same collective (group instance and `pg_seq`) across the ranks of
  its group: from the rank that entered it last, the one the others waited for, to each other.
Streaming like replay: the rank logs are merged by step, one step per rank is held, and events
are written as they are made, so memory is flat in the size of the logs.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import orjson

from runner_fsm.audit.records import lenient_records
from runner_fsm.replay.discover import Run
from runner_fsm.replay.report import ReplayReport
from runner_fsm.replay.rundirs import RunDirs
from runner_fsm.rules.rank_steps import StepMerger
from runner_fsm.rules.ranks import Groups, RankInfo
from runner_fsm.rules.verdicts import Verdict

STATE_TRIGGERS = {"prefill": "prefill", "decode": "decode", "idle": "idle_dummy", "draft": "draft_sync",
                  "capture": "capturing"}
PHASES = {1: "TARGET", 2: "DRAFT_PREFILL", 3: "DRAFT_DECODE"}
_HEADER = frozenset({"schema", "run_id", "seq", "t_ns", "dp_rank", "pcp_rank", "event", "step_id",
                     "phase", "stage", "pg_seq"})


@dataclasses.dataclass
class ExportStats:
    """What one export wrote."""

    ranks: int
    records: int
    events: int
    steps: int


class _Writer:
    """The trace file: one JSON object whose `traceEvents` array is written event by event."""

    def __init__(self, path: Path, other: dict):
        self._file = open(path, "wb")
        self._file.write(b'{"displayTimeUnit":"ns","otherData":' + orjson.dumps(other) + b',"traceEvents":[\n')
        self.events = 0
        self._pending: list[bytes] = []  # written in batches: one write per few thousand events

    def event(self, event: dict) -> None:
        self._pending.append(orjson.dumps(event))
        if len(self._pending) >= 4096:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write((b",\n" if self.events else b"") + b",\n".join(self._pending))
            self.events += len(self._pending)
            self._pending.clear()

    def close(self) -> None:
        self.flush()
        self._file.write(b"\n]}\n")
        self._file.close()


class _RankTrack:
    """One rank's thread: its open state slice and open collectives."""

    def __init__(self, info: RankInfo, out: _Writer, us, groups: Groups):
        self.info, self.out, self.us, self.groups = info, out, us, groups
        self.pid, self.tid = info.dp_rank, info.global_rank
        self.state_begin: int | None = None  # t_ns of the first record after the last transition
        self.last_transition: int | None = None
        self.open: dict[tuple, tuple[int, dict]] = {}  # (group, pg_seq) -> (t_ns, enqueue record)
        self.last_t: int | None = None
        self.step: int | None = None

    def slice(self, name: str, cat: str, begin: int, end: int, args: dict) -> None:
        self.out.event({"ph": "X", "name": name, "cat": cat, "ts": self.us(begin),
                        "dur": max(0.0, self.us(end) - self.us(begin)), "pid": self.pid, "tid": self.tid,
                        "args": args})

    def instant(self, name: str, cat: str, t: int, args: dict) -> None:
        self.out.event({"ph": "i", "s": "t", "name": name, "cat": cat, "ts": self.us(t), "pid": self.pid,
                        "tid": self.tid, "args": args})

    def record(self, rec: dict, collectives: dict) -> None:
        t = rec["t_ns"]
        self.last_t, event = t, rec.get("event")
        if self.state_begin is None and event != "transition":
            self.state_begin = t
        if event == "collective":
            self._collective(rec, t, collectives)
        elif event == "transition":
            self._transition(rec, t)
        elif event == "fault":
            self.instant(f"fault: {rec.get('error')}", "fault", t,
                         {"step": rec.get("step_id"), "error": rec.get("error"), "message": rec.get("message")})

    def _collective(self, rec: dict, t: int, collectives: dict) -> None:
        key = (rec.get("group"), rec.get("pg_seq"))
        if rec.get("stage") == "enqueue":
            self.open[key] = (t, rec)
            instance = self.groups.instance(str(key[0]), self.info.global_rank)
            collectives.setdefault((instance, key[1]), []).append((self.info.global_rank, t))
            return
        begun = self.open.pop(key, None)
        if begun is not None:
            self._close_collective(begun, t, rec, completed=True)

    def _close_collective(self, begun: tuple[int, dict], end: int, done: dict | None, *, completed: bool) -> None:
        start, enq = begun
        phase = enq.get("phase")
        phase = PHASES.get(phase, phase)
        args = {k: v for k, v in enq.items() if k not in _HEADER}  # sent, rows, shapes...
        if done is not None:
            args.update({k: v for k, v in done.items() if k not in _HEADER})  # agreed
        args["step"], args["phase"], args["pg_seq"] = enq.get("step_id"), phase, enq.get("pg_seq")
        args["completed"] = completed
        self.slice(f"{enq.get('group')} {enq.get('op')} {phase}", "collective", start, end, args)

    def _transition(self, rec: dict, t: int) -> None:
        trigger = rec.get("trigger")
        state = STATE_TRIGGERS.get(trigger)
        # A state with no record before its transition (a stall) began at the previous one.
        begin = next((b for b in (self.state_begin, self.last_transition) if b is not None), t)
        for begun in self.open.values():  # collectives never done end with their state's slice
            self._close_collective(begun, t, None, completed=False)
        self.open.clear()
        if state is not None:
            ok = rec.get("outcome") == "ok"
            self.slice(state if ok else f"{state} (failed)", "state", begin, t,
                       {"step": rec.get("step_id"), "trigger": trigger, "src": rec.get("src"),
                        "dst": rec.get("dst"), "outcome": rec.get("outcome")})
        self.last_transition, self.state_begin = t, None

    def finish(self) -> None:
        """The log ends: what is still open ends at its last record."""
        if self.last_t is None:
            return
        for begun in self.open.values():
            self._close_collective(begun, self.last_t, None, completed=False)
        self.open.clear()
        if self.state_begin is not None and self.state_begin < self.last_t:
            self.slice("unfinished", "state", self.state_begin, self.last_t,
                       {"step": self.step, "detail": "the log ends before the state's transition record"})


class _StepRecords:
    """One rank's records of one step (what `StepMerger` merges by `step`)."""

    __slots__ = ("step", "records")

    def __init__(self, step: int, records: list[dict]):
        self.step, self.records = step, records


def _rank_steps(info: RankInfo) -> Iterator[_StepRecords]:
    """One rank's log (every kept segment, in full: `records.lenient_records`), step by step;
    unreadable lines are skipped (replay reports them); a record without a step belongs to the
    step around it."""
    step, records = None, []
    for rec in _records(info):
        try:
            current = rec["step_id"]
            int(rec["t_ns"])
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(current, int) and current != step:
            if records:
                yield _StepRecords(step if step is not None else current, records)
            step, records = current, []
        records.append(rec)
    if records:
        yield _StepRecords(step if step is not None else -1, records)


def _records(info: RankInfo) -> Iterator[dict]:
    for segment in info.segments or ():
        yield from lenient_records(segment.path)


def _first_t(info: RankInfo) -> int | None:
    for rec in itertools.islice(_records(info), 64):
        try:
            return int(rec["t_ns"])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def export_perfetto(run_dir: RunDirs | Run, trace_path: str | os.PathLike[str],
                    report: ReplayReport | None = None) -> ExportStats:
    """Write the trace of the run in `run_dir` (its directories, or the `Run` found in them) to
    `trace_path`; `report` (replay's verdicts, computed here when not given) supplies the findings."""
    run = run_dir if isinstance(run_dir, Run) else Run.find(run_dir)
    if report is None:
        from runner_fsm.replay.judge import replay

        report = replay(run)
    infos = list(run.ranks)
    starts = [t for t in map(_first_t, infos) if t is not None]
    base = min(starts, default=0)
    out = _Writer(Path(trace_path), {"run_dir": run.label, "sound": report.sound,
                                     "findings": len(report.verdicts)})

    def us(t_ns: int) -> float:
        return (t_ns - base) / 1000.0

    groups = Groups(infos)
    tracks = {info.global_rank: _RankTrack(info, out, us, groups) for info in infos}
    _metadata(out, infos)
    by_step: dict[int | None, list[Verdict]] = {}
    for verdict in report.verdicts:
        by_step.setdefault(verdict.step, []).append(verdict)
    flows = itertools.count(1)
    records = steps = 0
    for step, ranks in StepMerger({info.global_rank: _rank_steps(info) for info in infos}):
        steps += 1
        collectives: dict[tuple, list] = {}
        present: dict[int, int] = {}
        for rank, part in ranks.items():
            track = tracks[rank]
            track.step = step
            for rec in part.records:
                track.record(rec, collectives)
            records += len(part.records)
            present[rank] = track.last_t
        _flows(out, tracks, collectives, flows, us)
        for verdict in by_step.pop(step, ()):
            _finding(tracks, verdict, present)
    for track in tracks.values():
        track.finish()
    for verdicts in by_step.values():  # no step, or a step no rank reached
        for verdict in verdicts:
            _finding(tracks, verdict, {r: t.last_t for r, t in tracks.items() if t.last_t is not None})
    out.close()
    return ExportStats(len(infos), records, out.events, steps)


def _metadata(out: _Writer, infos: list[RankInfo]) -> None:
    for replica in sorted({info.dp_rank for info in infos}):
        out.event({"ph": "M", "name": "process_name", "ts": 0, "pid": replica, "tid": 0,
                   "args": {"name": f"replica {replica}"}})
        out.event({"ph": "M", "name": "process_sort_index", "ts": 0, "pid": replica, "tid": 0,
                   "args": {"sort_index": replica}})
    for info in infos:
        out.event({"ph": "M", "name": "thread_name", "ts": 0, "pid": info.dp_rank, "tid": info.global_rank,
                   "args": {"name": info.rank_text()}})
        out.event({"ph": "M", "name": "thread_sort_index", "ts": 0, "pid": info.dp_rank,
                   "tid": info.global_rank, "args": {"sort_index": info.global_rank}})


def _flows(out: _Writer, tracks, collectives: dict, ids, us) -> None:
    """Arrows from the member that entered a collective last to every other member."""
    for (instance, pg_seq), entered in collectives.items():
        if len(entered) < 2:
            continue
        last_rank, last_t = max(entered, key=lambda item: item[1])
        for rank, t in entered:
            if rank == last_rank:
                continue
            flow = next(ids)
            source, target = tracks[last_rank], tracks[rank]
            out.event({"ph": "s", "id": flow, "name": "collective", "cat": "flow", "ts": us(last_t),
                       "pid": source.pid, "tid": source.tid})
            out.event({"ph": "f", "bp": "e", "id": flow, "name": "collective", "cat": "flow",
                       "ts": us(max(t, last_t)), "pid": target.pid, "tid": target.tid})


def _finding(tracks, verdict: Verdict, present: dict[int, int]) -> None:
    """An instant on each rank the finding names, at that rank's last record of the step."""
    if not present:
        return
    ranks = [r for r in verdict.ranks if r in tracks] or [min(present)]
    fallback = max(present.values())
    args = {"kind": verdict.kind, "detail": verdict.detail, "step": verdict.step, "replica": verdict.replica,
            "evidence": list(verdict.evidence)}
    for rank in ranks:
        track = tracks[rank]
        track.instant(f"finding: {verdict.kind}", "finding", present.get(rank, fallback), args)
