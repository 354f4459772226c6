"""One pass over one rank's log: the checks that need no peer, and a summary per step.

Checked here, by the rules of `checks`: `seq` runs gapless from 0 (`gap`); every transition
follows from the table and chains onto the previous one (`illegal_transition`); every forward,
eager or graph, reads inputs written for its step (`stale_buffer_replay`) through the PCP
context built for its batch (`stale_context`, by `context_rule`; a forward without the
identities is a `gap`, unjudged); the count sent to each agreement is the one the
logged batch yields (`dispatch_mismatch`) and the agreement gives it back (`agreed_mismatch`);
faults (`fault`: what the runner said, listed, never evidence) and logs that just stop
(`unfinished`).
What peers must agree on (collectives, agreements: read by `scan_collectives`) goes into a
`RankStep` per step, which `crossrank` merges across ranks. Only the current step is held: memory does not grow.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson

from runner_fsm.audit.decisions import DIGEST_FIELD, GATE_FIELD, DecisionTrail
from runner_fsm.audit.mapped import is_blank, rest_is_blank
from runner_fsm.replay.scan_collectives import CollectiveReader
from runner_fsm.rules.checks import BufferTracker, TransitionChecker
from runner_fsm.rules.context_rule import ContextEvidence
from runner_fsm.rules.facts import RunFacts
from runner_fsm.rules.rank_steps import RankStep, StepBuilder
from runner_fsm.rules.ranks import RankInfo
from runner_fsm.rules.verdicts import Verdict

TERMINAL_STATES = ("stopped", "faulted")
QUIESCENT_STATE = "ready"  # between steps: no forward, no collective, nothing half done
BETWEEN_STEPS = "the log ends between steps, in state 'ready'"
STEP_TRIGGERS = frozenset({"prefill", "decode", "idle"})
TIMEOUT_ERRORS = frozenset({"CollectiveTimeout", "TimeoutError"})


class RankScanner(CollectiveReader):
    """Feeds on one rank's records in file order; appends local verdicts to `verdicts`."""

    def __init__(self, info: RankInfo, verdicts: list[Verdict], facts: RunFacts | None = None):
        self.info = info
        self.file = info.file  # the file (segment) being read: where verdicts point
        self.verdicts = verdicts
        self.facts = RunFacts() if facts is None else facts  # stops, faults, injections, the end
        self.records = 0
        self.last_record: dict | None = None
        self.transitions = TransitionChecker(self._verdict)
        self.current: StepBuilder | None = None
        self._signatures: dict = {}  # equal signatures become one object
        self._next_seq = 0
        self._last_pg: dict[str, int] = {}  # group -> pg_seq of its last enqueue
        self._dangling: tuple | None = None  # the collective of the last record, if an enqueue
        self._truncated = False
        self._line = 0
        self._shapes: dict = {}  # (group, phase) -> (shapes as logged, frozen): each repeats
        # stale-buffer bookkeeping: snapshots are the raw `buffers` dicts of the records
        self.buffers = BufferTracker()
        self.stopped = False  # the scan ended at `stop_step`, not at the end of the file
        self.count_from: int | None = None  # count only records of steps from here on
        self._uncounted: int | None = None  # records read before the first such step
        self.contexts = ContextEvidence()
        self._resumed = False  # the next step follows a jump in the log (a seek, a rotation gap)
        self.decisions = DecisionTrail()  # its step decisions, as its `finish` records give them
        self.origin = None  # `seek.SeekOrigin` of the segment read, where it was read from a seek

    # -- verdicts ------------------------------------------------------------------

    def _verdict(self, kind: str, detail: str, *, step=None, line=None, error=None) -> None:
        step = step if step is not None else (self.current.step if self.current else None)
        line = line or self._line  # numbered from a seek: the lines before it are counted now
        line += self.origin.line_shift() if line and self.origin is not None else 0
        self.verdicts.append(Verdict(kind, self.info.dp_rank, step, detail, (self.info.global_rank,), self.file, line, error))

    # -- the per-line entry points -------------------------------------------------

    def scan(self, lines, stop_step: int | None = None, *, expand=None, first_line: int = 1) -> Iterator[RankStep]:
        """Every step of `lines` (a binary file), sealed when the next one starts; the last
        one comes from `finish()`, unless a record of `stop_step` or later ends the scan
        first (`self.stopped`): the steps from there on belong to another range. `expand`:
        the segment's `expand.Expander` (None: records in full); `first_line`: the line
        number of the first line read."""
        # The hot path of the whole checker, about ten lines per step and rank: the loop and
        # the header checks are inlined here; each event goes to one handler, rare cases to helpers.
        loads, decode_error = orjson.loads, orjson.JSONDecodeError
        handlers = {"collective": self._collective, "transition": self._transition,
                    "buffers": self._buffers, "graph": self._graph, "fault": self._fault,
                    "stop": self._rare, "injected": self._rare, "job": self._rare, "storage": self._rare,
                    "gate": self._gate}
        lean, collective_of = (expand.lean if expand is not None else None), self._collective_of
        collective = None  # a compact collective's own fields, as the expander reads them
        for line_no, raw in enumerate(lines, first_line):
            self._line = line_no
            try:
                record = loads(raw)
                if lean is not None:
                    collective = lean(record)
                seq, step = record["seq"], record["step_id"]
                event = "collective" if collective is not None else record["event"]
            except decode_error as err:
                if is_blank(raw) and rest_is_blank(lines):
                    return  # the unwritten tail of a log that was not closed (audit.mapped)
                if expand is not None:
                    expand.seq += 1  # the damaged line most likely held one record
                self._unparsable(raw, err)
                continue
            except (KeyError, TypeError, ValueError) as err:
                self._malformed(f"record lacks header field {err}" if isinstance(err, KeyError)
                                else "line is not a JSON object" if isinstance(err, TypeError)
                                else f"malformed compact record ({err})")
                continue
            self.records += 1
            self.last_record = record  # where the log ends (`facts.RankEnd`): its time
            if seq == self._next_seq:
                self._next_seq = seq + 1
            else:
                self._seq_gap(seq)
            current = self.current
            if current is None or (step != current.step and step is not None):
                if stop_step is not None and isinstance(step, int) and step >= stop_step:
                    self.records -= 1  # that record is the next range's
                    self.stopped = True
                    if current is not None:
                        yield current.seal(self.info.global_rank, self._signatures)
                    return
                finished = self._enter_step(step)
                if finished is not None:
                    yield finished
            self._dangling = None
            try:
                if collective is not None:
                    collective_of(collective, record)
                else:
                    handler = handlers.get(event)
                    if handler is not None:
                        handler(record)
            except (LookupError, TypeError, AttributeError, ValueError) as err:
                self._malformed(f"{event!r} record is malformed ({type(err).__name__}: {err})")

    @property
    def records_counted(self) -> int:
        uncounted = 0 if self.count_from is None else self._uncounted
        return 0 if uncounted is None else self.records - uncounted

    def resume_mid_file(self) -> None:
        """The next line is read after a jump ahead in the log (a seek, a rotation gap): trust
        its seq, state and counters instead of checking them against records that were
        skipped. The captures (read from the head of the log) are kept."""
        self._next_seq = None
        self.transitions.state = None
        self._last_pg.clear()
        self.buffers.forget_steps()
        self.current = self._dangling = None
        self._resumed = True

    def continue_with(self, job: dict | None, *, resumed: bool) -> None:
        """The next segment's `job` record, read past: one record of the log (its seq counts);
        the step after it is `resumed` when segments were rotated away in between."""
        self.records += 1
        seq = job.get("seq") if job is not None else None
        if self._next_seq is None or not isinstance(seq, int):
            self._next_seq = seq + 1 if isinstance(seq, int) else None
        elif seq == self._next_seq:
            self._next_seq = seq + 1
        else:
            self._seq_gap(seq)
        self._resumed = self._resumed or resumed

    def finish(self) -> RankStep | None:
        """The last step's summary, marked as the end of this rank's log."""
        last = self.current
        if last is None:
            if not self._truncated and self.records == 0:
                self._verdict("gap", "the file holds no record: the process wrote nothing", step=None,
                              line=0)
            return None
        hang, timed_out = self._dangling, False
        if hang is None and (last.fault is None or last.fault[0] in TIMEOUT_ERRORS):
            # The log ends with a collective open: the rank stopped in it. A fault of another
            # error only explains it away (the collective ran, its rule refused the result).
            hang = last.open_collective()
            timed_out = hang is not None and last.fault is not None
        state = self.transitions.state
        if hang is None and not self._truncated and state not in TERMINAL_STATES:
            # Between steps every step it began, it finished; a stop request recorded in the job
            # before the log ends may explain it (`rules.stops`), nothing else does.
            self._verdict("unfinished", f"{BETWEEN_STEPS} after step {last.step}, without shutdown (process killed"
                          " between steps, or still running?)" if state == QUIESCENT_STATE else
                          f"the log ends in state {state!r} at step {last.step} without shutdown, fault or a"
                          " collective in flight (process killed or still running?)")
        return last.seal(self.info.global_rank, self._signatures, ended=True, hang=hang, timed_out=timed_out)

    # -- gaps ----------------------------------------------------------------------

    def _enter_step(self, step) -> RankStep | None:
        if self._uncounted is None and self.count_from is not None and isinstance(step, int) \
                and step >= self.count_from:
            self._uncounted = self.records - 1  # this record is the first one counted
        current = self.current
        if current is None:
            self.current = StepBuilder(step if isinstance(step, int) else -1, self._line, self._resumed,
                                       self.buffers.captured)
            self._resumed = False
            return None
        if step == current.step or step is None:
            return None
        if not isinstance(step, int) or step < current.step:
            self._verdict("gap", f"step_id goes back from {current.step} to {step!r}: records out of order")
            return None
        self.current = StepBuilder(step, self._line, self._resumed, self.buffers.captured)
        self._resumed = False
        self.buffers.new_step()
        return current.seal(self.info.global_rank, self._signatures)

    # -- events --------------------------------------------------------------------

    def _transition(self, record) -> None:
        trigger, outcome = record["trigger"], record["outcome"]
        self.transitions.check(trigger, record["src"], record["dst"], outcome, self._line)
        if record["dst"] == "faulted":
            self.current.faulted = True
        if outcome == "ok":
            if trigger in STEP_TRIGGERS:
                self.current.kind = trigger
            elif trigger == "draft":
                self.current.drafted = True
        if DIGEST_FIELD in record:  # a step's decisions, on its `finish` (ok, or its consensus check failed)
            self.decisions.finish(self.current, record)

    def _gate(self, record) -> None:
        """The drafter's gate (`decisions.GATE_EVENT`): written before any drafter collective."""
        self.current.gate = int(record[GATE_FIELD])

    def _fault(self, record) -> None:
        error, message = str(record["error"]), str(record["message"])
        self.current.fault = self.current.fault or (error, message)  # the first one is the cause
        self._verdict("fault", f"{error}: {message}", error=error)
        self.facts.note(self.info.global_rank, record, self.origin)

    def _rare(self, record) -> None:
        """`stop`, `injected`, `job`, `storage`: kept whole for the rules judged over the job (`facts`)."""
        self.facts.note(self.info.global_rank, record, self.origin)

    def _buffers(self, record) -> None:
        for detail in self.buffers.buffers(record, self.current.step):
            self._verdict("stale_buffer_replay", detail)

    def _graph(self, record) -> None:
        for detail in self.buffers.graph(record, self.current.step):
            self._verdict("stale_buffer_replay", detail)

