"""One replica's record of vLLM's steps: its step id, state machine, audit log and journal.

`ReplicaRecorder` is the one object the worker calls around each vLLM call; other parts of
the integration (the DP agreement, the watchdog) read `step_id`, `kind` and `audit` from it.
Step ids count the worker's steps from 0 (a real step or an idle dummy); start-up and graph
capture are step -1. Per step the audit log gets the transitions, the `buffers` records of each
target forward (see `probe`), and a `graph` record per FULL-graph capture or replay; the
journal gets what vLLM decided (see `journal`). A forward's `buffers` record holds the
attention metadata a replay is judged on (reason `real`, `dummy` or `capture`; `:copied=...`
when the forward was handed copies, not vLLM's persistent buffers); the content hashes of
all its inputs go into the journal (`inputs`). A step's start is on disk before its forward
runs (a replica killed mid-step leaves it as its last record); the records of its forwards
are written when it ends, with `finish`, in one write, so that on an accelerator the content
hashes are read back after the step, never before a graph replay.
"""

from __future__ import annotations

from typing import Any

from runner_fsm.audit import AuditLog
from runner_fsm.audit.decisions import StepDecisions
from runner_fsm.audit.log import AuditBatch
from runner_fsm.integrations.vllm.recording.fsm import StepMachine
from runner_fsm.integrations.vllm.recording.journal import Journal, Later
from runner_fsm.integrations.vllm.recording.probe import resolve
from runner_fsm.integrations.vllm.recording.steps import NO_FORWARD, StepCore
from runner_fsm.states import State, Trigger

CAPTURE_STEP = -1


_DRAFT, _FINISH = Trigger.DRAFT, Trigger.FINISH  # module globals: an enum member is a class lookup


class ReplicaRecorder(StepCore):
    """A replica's recorder: its step path (`begin_step`, `forward_hook`, `end_step`) is
    `steps.StepCore`'s, compiled where built, on the fields `__init__` sets."""

    def __init__(self, audit: AuditLog, journal: Journal | None, *, fingerprints: bool = True):
        self.audit = audit
        self.journal = journal
        self._pending = journal.pending if journal is not None else None  # its entries not rendered yet
        self.machine = StepMachine(audit)
        self.fingerprints = fingerprints  # False: audit level "transitions" (no buffers records)
        self.step_id = CAPTURE_STEP  # the step being run, or the next one between steps
        self.kind: str | None = None  # "prefill" | "decode" | "idle" while a step runs
        self.fault_cause: BaseException | None = None
        self._forwards: list[tuple] = []  # this step's forwards that leave records, written when it ends
        self._last_forward: tuple = NO_FORWARD  # this step's last target forward: (graph mode, batch descriptor)
        self._entry: dict | None = None  # this step's journal entry
        self._end = audit.batch()  # the records of a step's end (one batch, reused every step)
        self._last_values: tuple | None = None  # the decisions the last `finish` carried, as a tuple
        self._batch = (0, 0)  # this step's batch: (its identity, the tokens scheduled)
        # The last real batch's requests and tokens, in its order, and its `_batch`: a run of
        # steps over the same batch (decode) keeps one identity, computed once.
        self._last_batch: tuple = ([], [], (0, 0))
        self._gated: int | None = None  # drafter steps this step's gate let run (None: no gate asked)
        self._decided_now: tuple | None = None  # the last ended step's decisions (`decided`), as values
        self.after_end = None  # called once a step's records are written (`replica_check.after_step`)

    # -- start-up -------------------------------------------------------------------

    def start_capture(self) -> None:
        """Warm-up, profiling and graph capture run in `capturing` (idempotent)."""
        if self.machine.is_(State.INIT):
            self.machine.fire(Trigger.CAPTURE, CAPTURE_STEP)

    def end_capture(self) -> None:
        self.start_capture()
        self._write_forwards(CAPTURE_STEP)
        self.machine.fire(Trigger.CAPTURED, CAPTURE_STEP)
        self.step_id = 0

    # -- steps ----------------------------------------------------------------------

    @property
    def in_step(self) -> bool:
        return self.kind is not None

    def on_forward(self, taken: dict | None, copied: list[str] | tuple, dummy: bool, mode: str, desc: Any,
                   dp_counts: Any, logged: bool = False) -> None:
        """A target forward is about to run (called from the forward pre-hook). `logged`: its
        `buffers` record is on disk already (the PCP evidence, written before the forward):
        the probe's hashes then go to the journal only."""
        self._last_forward = (mode, desc)
        if taken is not None or mode == "FULL":  # a buffers or a graph record (eager at `transitions`: none)
            self._forwards.append((taken, copied, dummy, mode, desc, logged))
        entry = self._entry
        if entry is not None:
            entry.setdefault("forwards", []).append([("dummy" if dummy else "real"), mode, desc, dp_counts])


    def note(self, **fields: Any) -> None:
        """Add what vLLM decided to this step's journal entry (sampled tokens, drafts, ...)."""
        if self._entry is not None:
            self._entry.update(fields)

    def note_later(self, name: str, source: Any, attr: str) -> None:
        """A journal field whose value exists only after the step (an async output vLLM's engine
        resolves later): `getattr(source, attr)` when the entry is rendered (`journal.Later`),
        left out if it is empty or missing then."""
        if self._entry is not None:
            self._entry[name] = Later(source, attr)

    def _end_with_records(self, step: int, drafted: bool, tail: bytes) -> None:
        """A step's end with records before its `finish`: its forwards' and `draft`, one write."""
        batch = self._end
        try:
            if self._forwards:
                self._write_forwards(step, batch)
            if drafted:
                self.machine.fire(_DRAFT, step, batch, now=False)
            self.machine.fire(_FINISH, step, batch, tail)  # the batch's records, then `finish`
        finally:
            batch.write()  # what is left: a refused trigger's record, before the error reaches vLLM

    def gate(self, draft_steps: int) -> None:
        """The drafter's gate decided for this step: logged at once, before any collective of
        the drafter (a rank whose peer's gate said otherwise may wait in one for ever)."""
        self._gated = draft_steps
        self.audit.gate(self.step_id, draft_steps)

    @property
    def decided(self) -> StepDecisions | None:
        """The last ended step's decisions (`replica_check`); None while a step runs."""
        decided = self._decided_now
        return None if decided is None else StepDecisions(*decided)

    def _write_forwards(self, step: int, out: AuditLog | AuditBatch | None = None) -> None:
        out = self.audit if out is None else out
        forwards, self._forwards = self._forwards, []
        capturing = step == CAPTURE_STEP
        for taken, copied, dummy, mode, desc, logged in forwards:
            graph = mode == "FULL"
            if graph and capturing:  # a capture first names its size, then its buffers
                out.graph(step, "capture", num_tokens=desc[0] if desc else None)
            if taken is not None:
                # A graph replay's inputs are logged as `replay`: replay judges them right there,
                # against the capture of the same size.
                reason = "capture" if capturing else "replay" if graph else "dummy" if dummy else "real"
                inputs, record = resolve(taken, reason, copied, desc[0] if graph and desc else None)
                if not logged:
                    out.rendered("buffers", step, record)
                if self._entry is not None:
                    self._entry.setdefault("inputs", []).append(inputs)
            if graph and not capturing:
                out.graph(step, "replay", num_tokens=desc[0] if desc else None, dummy=dummy)

    def _flush_entry(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None and self.journal is not None:
            self.journal.write(entry)

    # -- faults and the end -----------------------------------------------------------

    def fault(self, error: BaseException) -> None:
        """Log `error` and move to `faulted` (once; later errors only add a fault record)."""
        step = self.step_id
        if self.fault_cause is None:
            self.fault_cause = error
        self.audit.fault(step, error, str(error))
        try:
            self._write_forwards(step)
            self._flush_entry()  # what vLLM decided for the broken step, on disk with the rest
            if self.journal is not None:
                self.journal.flush()
        except Exception:  # noqa: BLE001 - evidence of a broken step is best effort
            pass
        if not self.machine.is_(State.FAULTED) and not self.machine.is_(State.STOPPED):
            self.machine.fire(Trigger.FAULT, step)
        self.kind = None

    def shutdown(self, reason: str = "vLLM shut the worker down") -> None:
        if self.audit.closed:
            return
        try:
            self._flush_entry()
            if self.in_step or self.machine.is_(State.CAPTURING):
                self.fault(RuntimeError(f"{reason} in the middle of step {self.step_id}"))
            self.machine.fire(Trigger.SHUTDOWN, self.step_id)
        finally:
            try:
                if self.journal is not None:
                    self.journal.close()
            finally:
                self.audit.close()  # cuts the blank tail, whatever the journal did
