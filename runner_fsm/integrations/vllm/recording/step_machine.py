"""The replica state machine for a worker driven by vLLM: the runner's `TransitionCore`.

vLLM calls its worker synchronously, one call at a time, and the work of each step is vLLM's
own, so the worker needs no handlers: its edges are those of the core both drivers of
`machine` move (the one table, the same refusals, the same `fault` edge), and each trigger becomes one
`transition` record of the audit log, exactly as the embedded runner writes them, under the
step id the worker gives.

Two or three triggers fire per vLLM step, each right after vLLM's own work evicted the CPU
caches, where every call and object touched costs about a microsecond: `fire` is one lookup
of the edge (the core's, asked the first time each edge is taken and kept with its record's
bytes) and one write, `AuditLog.step_transition`, where the driver's `fire` went through six
calls to the same record.
"""

from __future__ import annotations

from runner_fsm.audit import AuditLog
from runner_fsm.audit.compact import transition_body
from runner_fsm.audit.log import AuditBatch
from runner_fsm.integrations.vllm.common.errors import StepRefused
from runner_fsm.states import State, Trigger
from runner_fsm.states.machine import TransitionCore


def _body(trigger: Trigger, src: State, dst: State, outcome: str) -> bytes:
    """A `transition` record's fields, rendered (what `AuditLog.transition` renders)."""
    return transition_body(trigger.value, src.value, dst.value, outcome)


class StepMachine:
    """One replica's state; `fire(trigger, step_id)` moves it and logs the transition."""

    def __init__(self, audit: AuditLog | None):
        self.audit = audit
        self._core = TransitionCore()  # the table: asked once per edge (`_first_move`)
        self.now = self._core.state  # the replica's state (the core's is set when it is asked)
        self.moves: dict[tuple[State, Trigger], tuple[State, bytes]] = {}  # (src, trigger) -> (dst, ok record)

    @property
    def state(self) -> str:
        return self.now.value

    def fire(self, trigger: Trigger, step_id: int | None, batch: AuditBatch | None = None,
             decided: bytes = b"", *, now: bool = True) -> None:
        """Move on `trigger` and write its record at once (`AuditLog.step_transition`), after
        what `batch` holds; `now=False`: the record joins `batch` instead, written when it is.
        A trigger the table forbids is logged `refused` (into `batch` where there is one) and
        raised. `decided`: the step's decisions a `finish` carries, rendered
        (`compact.decisions_tail`)."""
        move = self.moves.get((self.now, trigger))
        if move is None:  # the edge's first time (a handful of edges), or a refusal
            move = self._first_move(trigger, step_id, batch)
        dst, body = move
        self.now = dst
        audit = self.audit
        if audit is None:
            return
        if now:
            audit.step_transition(step_id, body, decided, batch)
        elif decided:
            batch.rendered_transition(step_id, body, decided)
        else:
            batch.rendered("transition", step_id, body)

    def _first_move(self, trigger: Trigger, step_id: int | None, batch: AuditBatch | None) -> tuple[State, bytes]:
        """The edge of `trigger` from the current state, looked up in the core and kept with its
        record's body rendered; a refused trigger is logged and raised (nothing moved)."""
        self._core.take(self.now)  # the core answers from the replica's state
        src, dst = self._core.edge(trigger)
        if dst is None:
            out = self.audit if batch is None else batch
            if out is not None:
                out.rendered("transition", step_id, _body(trigger, src, src, "refused"))
            raise StepRefused(f"{trigger.value!r} is not allowed in state {src.value!r}")
        move = self.moves[(src, trigger)] = (dst, _body(trigger, src, dst, "ok"))
        return move

    def is_(self, state: State) -> bool:
        return self.now is state
