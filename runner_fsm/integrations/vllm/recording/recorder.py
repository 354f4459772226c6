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
from runner_fsm.audit.compact import decisions_tail
from runner_fsm.audit.decisions import StepDecisions, batch_identity, changed_since, decide
from runner_fsm.audit.log import AuditBatch
from runner_fsm.integrations.vllm.recording.forwards import forward_context
from runner_fsm.integrations.vllm.recording.journal import BATCH as JOURNAL_BATCH, Journal, Later
from runner_fsm.integrations.vllm.recording.probe import resolve
from runner_fsm.integrations.vllm.recording.step_machine import StepMachine
from runner_fsm.states import State, Trigger

CAPTURE_STEP = -1
STEP_TRIGGERS = {"prefill": Trigger.PREFILL, "decode": Trigger.DECODE, "idle": Trigger.IDLE}
NO_FORWARD = ("NONE", None)  # a step with no target forward: eager, no rows

_DRAFT, _FINISH = Trigger.DRAFT, Trigger.FINISH  # module globals: an enum member is a class lookup


def changed_tail(digest: int, last: tuple | None, values: tuple) -> bytes:
    """A `finish` record's tail where a decision changed: the digest and the changes."""
    return decisions_tail(digest, changed_since(last, values))


def new_batch(keys: list, tokens: list) -> tuple[int, int]:
    """A real step's batch: its identity and the tokens scheduled."""
    return batch_identity(keys, tokens), sum(tokens)


class ReplicaRecorder:
    """A replica's recorder. Its step path (`begin_step`, `forward_hook`, `end_step`) runs once
    per vLLM step (the hook once per forward), right after vLLM's own work evicted the CPU
    caches, where each Python frame and cold object costs about a microsecond: so it reads its
    own fields, few of them, and most steps write one transition at each end."""

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

    # -- the step path ----------------------------------------------------------------

    def begin_step(self, kind: str, decision: dict | None = None, scheduled: dict | None = None, *,
                   entry: dict | None = None) -> int:
        """Enter a step of `kind`; returns its id. `decision`: fields of its journal entry, or
        `entry`: the entry itself, its step and kind first (`journal.step_entry`); `scheduled`:
        {request id: tokens} of a real step."""
        previous, pending = self._entry, self._pending
        if previous is not None and pending is not None:  # the previous step's journal entry: complete now
            pending.append(previous)  # `Journal.write`, inline: a call and an object less a step
            self._entry = None  # handed over: a refused move below must not hand it over twice
            if len(pending) >= JOURNAL_BATCH:
                self.journal.render()
        step = self.step_id
        self.machine.fire(STEP_TRIGGERS[kind], step)  # raises StepRefused: nothing changed
        self.kind, self._gated, self._decided_now, self._last_forward = kind, None, None, NO_FORWARD
        if scheduled:
            order, counts, batch = self._last_batch
            keys, tokens = [*scheduled], [*scheduled.values()]  # in the batch's order: the identity depends on it
            if keys != order or tokens != counts:  # two lists, not the last dict's table: fewer cold lines
                batch = new_batch(keys, tokens)
                self._last_batch = (keys, tokens, batch)
            self._batch = batch
        else:
            self._batch = (0, 0)
        self._entry = entry if entry is not None else {"step": step, "kind": kind, **(decision or {})}
        return step

    def forward_hook(self, _module: Any, _args: tuple, _kwargs: dict) -> None:
        """The forward pre-hook where forwards leave no `buffers` record (audit `transitions`)
        and the runner reads no PCP evidence: `on_forward` for what vLLM's forward context says,
        called by torch itself. A dummy forward is an idle step's; outside steps (warm-up,
        capture) only a graph capture counts."""
        mode, desc, dp_counts = forward_context()
        kind = self.kind
        if kind is None and mode != "FULL":
            return
        dummy = kind == "idle"
        self._last_forward = (mode, desc)
        if mode == "FULL":  # a graph record (eager at `transitions`: none)
            self._forwards.append((None, (), dummy, mode, desc, False))
        if (entry := self._entry) is not None:
            entry.setdefault("forwards", []).append([("dummy" if dummy else "real"), mode, desc, dp_counts])

    def end_step(self, drafted: bool = False, draft_steps: int = 0, sampled: list | None = None) -> None:
        """The step's forwards are over. Its records (buffers and graph records, `draft` when
        the drafter ran — proposals, or its dummy run on an idle replica — and `finish`, with the
        step's decisions: `draft_steps` drafter steps) are written together, in one write.
        `sampled`: the tokens the step sampled, one list per request (also noted in the journal),
        where `note` did not give them already.

        The step's decisions (`audit.decisions`), rendered for its `finish` record: its last
        target forward's graph mode and padded size, as vLLM's forward context gave them; the
        sampled tokens where they are known by now (not an async output's: MRV2 resolves them
        after the step). The digest and the decisions changed since the last `finish`, as
        `decisions.changed_since` gives them (all of them the first time)."""
        entry = self._entry
        if sampled is not None:
            if entry is not None:
                entry["sampled"] = sampled
        elif entry is not None:
            sampled = entry.get("sampled")  # `note(sampled=...)`; not known yet where `note_later` gave them
            if type(sampled) is Later:
                sampled = None
        gated = self._gated
        if gated is not None:  # the drafter's gate decided this step (`gate`)
            self._gated = None
            drafted, draft_steps = gated > 0, gated
        mode, desc = self._last_forward
        size = desc[0] if desc else 0
        identity, scheduled = self._batch
        # `real` as 0/1: the values `changed` compares are the digest's first six, as they are
        values = (0 if self.kind == "idle" else 1, identity, scheduled, size, size if mode == "FULL" else 0,
                  draft_steps if drafted else 0)
        # The digests and, where no decision changed (most of a decode run), the tail, in one call
        tokens, digest, tail = decide(values, sampled, self._last_values)
        self._decided_now = (*values, tokens)
        if tail is None:  # a decision changed (or the first step): the changes rendered too
            tail = changed_tail(digest, self._last_values, values)
            self._last_values = values
        step = self.step_id
        if self._forwards or drafted:
            self._end_with_records(step, drafted, tail)
        else:  # most steps: `finish` alone, no batch
            self.machine.fire(_FINISH, step, None, tail)
        self.kind = None
        self.step_id = step + 1
        if self.after_end is not None:
            self.after_end()

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
