"""Joining the Flight Recorder dumps to the audit logs, by group and sequence number.

The DP agreement's group carries nothing but the agreement (DESIGN section 5), and each
agreement is one audit record pair, so there the two sources count the same collectives:
Flight Recorder seq `k` is the audit log's `pg_seq` `k - 1` (torch counts from 1, the log
from 0). Other groups carry the model's own collectives, many per audited forward, and are
described but not joined.

What the join adds to a replay:
- a `hang` verdict says, per the Flight Recorder, which ranks never started (or never
  completed) the collective, and per the audit log which transition each rank was in;
- a collective that gloo matched across ranks (same seq) while the audit log shows the ranks
  ran it for different steps or phases (a skipped collective, caught one later) is named on
  the verdict of that step;
- `source_disagreement`: the two sources count a rank's collectives differently;
- `missing_rank`: a rank the dumps name (by its own dump or as a member of a group) that left
  no audit log, when the logs' own job shape did not name it already (logs of an older writer).
Verdicts that used the dumps carry `evidence` ("audit", "flight_recorder").
Only the tail of each audit log is read: memory stays flat in the size of the logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from runner_fsm.agree.order import past_last_phase
from runner_fsm.audit.mapped import data_end
from runner_fsm.audit.records import lenient_records
from runner_fsm.replay.discover import Run
from runner_fsm.replay.flight import RankDump, describe, group_views, in_flight, named_ranks, read_dumps
from runner_fsm.replay.report import ReplayReport
from runner_fsm.rules.ranks import RankInfo, job_last_phase
from runner_fsm.rules.verdicts import Verdict, sort_verdicts

SEQ_JOINED_GROUPS = ("dp",)  # groups whose every torch collective is one audited collective
BOTH = ("audit", "flight_recorder")
_TAIL_BYTES = 1 << 18  # the last steps of a log: where a hang or a desync shows
_PHASES = {1: "TARGET", 2: "DRAFT_PREFILL", 3: "DRAFT_DECODE"}


@dataclasses.dataclass
class AuditTail:
    """The end of one rank's audit log: its last transition and its last collectives."""

    info: RankInfo
    last_transition: dict | None = None
    collectives: dict[tuple[str, int], dict] = dataclasses.field(default_factory=dict)  # (group, pg_seq)
    last_pg: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> last enqueued pg_seq
    done: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # (group, pg_seq) logged done
    stopped: bool = False  # a stop request is on record in the end of its log

    def where(self) -> str:
        """Which transition the rank was in when its log ends, in words."""
        t = self.last_transition
        if t is None:
            return f"rank {self.info.global_rank}: no transition in the end of its log"
        move = f"{t.get('trigger')} ({t.get('src')} -> {t.get('dst')}) at step {t.get('step_id')}"
        if t.get("outcome") == "ok" and t.get("dst") == "ready":
            return f"rank {self.info.global_rank}: between steps (last: {move})"
        if t.get("outcome") == "ok":
            return f"rank {self.info.global_rank}: {move}"
        return f"rank {self.info.global_rank}: in {move}, which failed"


def read_tail(info: RankInfo) -> AuditTail:
    tail = AuditTail(info)
    segment = info.segments[-1] if info.segments else None
    path = segment.path if segment is not None else info.path
    size = data_end(path)  # without the blank tail of a log that was not closed
    for record in lenient_records(path, max(0, size - _TAIL_BYTES)):
        event = record.get("event")
        if event == "transition":
            if record.get("trigger") != "fault":  # the fault edge says nothing of where it was
                tail.last_transition = record
        elif event == "collective" and isinstance(record.get("pg_seq"), int):
            key = (record.get("group"), record["pg_seq"])
            if record.get("stage") == "enqueue":
                tail.collectives[key] = record
                tail.last_pg[key[0]] = key[1]
            elif record.get("stage") == "done":
                tail.done.add(key)
        elif event == "stop":
            tail.stopped = True
    return tail


def join_flight_recorder(report: ReplayReport, run: Run) -> ReplayReport:
    """`report` with the Flight Recorder dumps of `run` joined in (itself when there are none)."""
    dumps = read_dumps(run.dirs)
    if not dumps:
        return report
    tails = {info.global_rank: read_tail(info) for info in run.ranks}
    verdicts = list(report.verdicts)
    found: list[Verdict] = _missing_logs(dumps, tails, verdicts)
    for view in group_views(dumps):
        name = next((dumps[r].names.get(view.pg) for r in view.members if view.pg in dumps[r].names), None)
        if name is None:
            continue
        seq = _seq_of_interest(dumps, view)
        if name not in SEQ_JOINED_GROUPS:  # where it stopped tells only about the end of the run
            if seq is not None:
                verdicts = _annotate_hang(verdicts, dumps, view, name, seq, tails, _last_hang_step(verdicts))
            continue
        found += _disagreements(view, name, tails)
        if seq is not None:
            records = [tails[r].collectives.get((name, seq - 1)) for r in view.members if r in tails]
            steps = {rec["step_id"] for rec in records if rec is not None}
            verdicts = _annotate_hang(verdicts, dumps, view, name, seq, tails, steps, f" (audit pg_seq {seq - 1})")
        verdicts = _annotate_rematched(verdicts, dumps, view, name, tails)
    return dataclasses.replace(report, verdicts=sort_verdicts(verdicts + found))


def _missing_logs(dumps: dict[int, RankDump], tails: dict[int, AuditTail], verdicts) -> list[Verdict]:
    """`missing_rank` for each rank the dumps name that has no audit log (and no verdict yet)."""
    known = {rank for v in verdicts if v.kind == "missing_rank" for rank in v.ranks}
    shape = next((tail.info.shape for tail in tails.values() if tail.info.shape is not None), None)
    pcp_size = 1 + max((tail.info.pcp_rank for tail in tails.values()), default=0)

    def replica(rank: int) -> int:
        return shape.coords(rank).dp if shape is not None and rank < shape.world_size else rank // pcp_size
    return [Verdict("missing_rank", replica(rank), None, f"rank {rank} left no audit log, though"
                    f" {'it left a Flight Recorder dump' if rank in dumps else why}; nothing it did can be judged",
                    (rank,), f"rank-{rank}.jsonl", evidence=BOTH)
            for rank, why in sorted(named_ranks(dumps).items()) if rank not in tails and rank not in known]


def _seq_of_interest(dumps, view) -> int | None:
    """Where the group stopped: the first seq some members never started, else the last one
    still in flight on some member."""
    first = view.first_difference()
    if first is not None:
        return first
    last = max(view.enqueued.values(), default=0)
    return last if last and in_flight(dumps, view, last) else None


def _last_hang_step(verdicts) -> set:
    """The step where the run stopped in a hang ({} when none): a group whose collectives the
    audit log does not count one by one (the expert exchange: many per audited forward) is
    joined there, where the Flight Recorder shows it stopped."""
    steps = [v.step for v in verdicts if v.kind == "hang" and v.step is not None]
    return {max(steps)} if steps else set()


def _annotate_hang(verdicts, dumps, view, name, seq, tails, steps, audit_seq: str = "") -> list[Verdict]:
    """Add what the Flight Recorder saw at `seq` to the hang verdicts of `steps`."""
    behind = set(view.behind(seq))
    out = []
    for verdict in verdicts:
        if verdict.kind == "hang" and verdict.step in steps and set(verdict.ranks) & (set(view.members) | behind):
            where = "; ".join(tails[r].where() for r in view.members if r in tails)
            detail = (f"{verdict.detail}; flight recorder: {describe(dumps, view, seq)}{audit_seq};"
                      f" audit log: {where}")
            verdict = dataclasses.replace(verdict, detail=detail, evidence=BOTH)
            if behind and not behind & set(verdict.ranks) and not _extra_draft_pass(verdict, name, seq, tails):
                out.append(Verdict("source_disagreement", verdict.replica, verdict.step,
                                   f"the audit log blames rank(s) {_ids(verdict.ranks)} for the hang in group"
                                   f" {name}, the Flight Recorder shows rank(s) {_ids(sorted(behind))} never"
                                   f" started #{seq}", tuple(sorted(behind)), evidence=BOTH))
        out.append(verdict)
    return out


def _extra_draft_pass(verdict, name, seq: int, tails) -> bool:
    """The hang's blamed ranks wait at `seq` in a phase past the last of any step (`agree.order`,
    rule 0): the members the Flight Recorder shows never starting it rightly did not."""
    last = job_last_phase(tail.info for tail in tails.values())
    waits = [tails[r].collectives.get((name, seq - 1)) for r in verdict.ranks if r in tails]
    return bool(waits) and all(rec is not None and past_last_phase(rec.get("phase"), last) for rec in waits)


def _annotate_rematched(verdicts, dumps, view, name, tails) -> list[Verdict]:
    """A seq that gloo completed as one collective while the audit log shows its members ran it
    for different (step, phase): the skip that the next collective caught. The DP agreement is
    passed with a phase-specific shape (`dp.wire_shape`), so the Flight Recorder shows it too."""
    common = set.intersection(*(set(k for k in tails[r].collectives if k[0] == name) for r in view.members
                                if r in tails)) if view.members else set()
    for key in sorted(common, key=lambda k: k[1]):
        records = {r: tails[r].collectives[key] for r in view.members if r in tails}
        seen = {(rec["step_id"], rec.get("phase")) for rec in records.values()}
        if len(seen) < 2:
            continue
        first_step = min(step for step, _ in seen if isinstance(step, int))
        ran = "; ".join(f"rank {r} as step {rec['step_id']} {_PHASES.get(rec.get('phase'), rec.get('phase'))}"
                        for r, rec in sorted(records.items()))
        note = (f"flight recorder: group {name} collective #{key[1] + 1} (pg {view.pg}) was issued by rank(s)"
                f" {_ids(view.members)} and matched by gloo as one collective, but the audit log says {ran}"
                f"{_recorded(dumps, view, key[1] + 1)}")
        for index, verdict in enumerate(verdicts):
            if verdict.step == first_step and verdict.kind != "fault" and set(verdict.ranks) & set(view.members):
                verdicts[index] = dataclasses.replace(verdict, detail=f"{verdict.detail}; {note}", evidence=BOTH)
                break
        break  # the first such seq is the cause; later ones follow from it
    return verdicts


def _recorded(dumps, view, seq: int) -> str:
    """`; the Flight Recorder recorded ...` per distinct entry at `seq` ('' when no dump has it)."""
    sides: dict[str, list[int]] = {}
    for rank in view.members:
        entry = dumps[rank].entry(view.pg, seq)
        if entry is not None:
            sides.setdefault(entry.label, []).append(rank)
    if not sides:
        return ""
    return "; the Flight Recorder recorded " + "; ".join(f"{label} on rank(s) {_ids(rs)}"
                                                          for label, rs in sides.items())


def _disagreements(view, name: str, tails) -> Iterable[Verdict]:
    """Per member: the audit log and the Flight Recorder must count the same collectives.
    (Completion is not compared: gloo marks a collective retired from its own thread a moment
    after the caller's wait returns, so the last one may still show in flight in a dump taken
    right after it.)"""
    for rank in view.members:
        tail = tails.get(rank)
        if tail is None:
            continue
        logged = tail.last_pg.get(name)
        counted = view.enqueued[rank]
        step = tail.collectives[(name, logged)]["step_id"] if logged is not None else None
        if logged is not None and logged == counted and tail.stopped and (name, logged) not in tail.done:
            # Stopped on purpose between the record and the call: the rank's handler records the
            # request at once, the run is cancelled at its next await, which is the wait for this
            # collective's worker thread; it may never have handed it to torch (seen: a Ctrl-C
            # at step 0 of a DP=2 run, tests/test_stop_race.py). The stop is named in the notes.
            continue
        if logged is not None and logged + 1 != counted:
            why = ("a collective ran unlogged or its record is lost" if counted > logged + 1 else
                   "the log announced a collective torch never issued (stopped between the record and the call?)")
            yield Verdict("source_disagreement", tail.info.dp_rank, step,
                          f"group {name}: the audit log's last collective is pg_seq {logged} (Flight Recorder #"
                          f"{logged + 1}), the Flight Recorder counts #{counted}: {why}", (rank,), tail.info.file,
                          evidence=BOTH)


def _ids(ranks) -> str:
    return ", ".join(map(str, ranks))
