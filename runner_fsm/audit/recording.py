"""The records an audit log holds (DESIGN section 7), made by `AuditLog` and `AuditBatch` alike.

`_Records` builds each typed record and hands it to `_emit`; `AuditLog` (`log`) writes it at
once, `AuditBatch` collects records made now and writes them together (`log`'s docstring says
why). The vocabulary of the records lives here too: their header fields and events.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from runner_fsm.audit import compact
from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, GATE_EVENT, GATE_FIELD
from runner_fsm.audit.render import snapshot

HEADER_FIELDS = ("schema", "run_id", "seq", "t_ns", "dp_rank", "pcp_rank", "event", "step_id")
_RESERVED = frozenset(HEADER_FIELDS) | compact.KEYS
COLLECTIVE_STAGES = ("enqueue", "done")
GRAPH_ACTIONS = ("capture", "replay", "warmup")  # warmup: a whole step vLLM runs before capture
# `job`: the job's shape, the first record of a log (`audit.shape`); `stop`: a stop request the rank
# received (a signal, the engine's shutdown call), written the moment it arrives (`stop_signals`);
# `injected`: an injected fault acting (`faults`); `gate`: whether the drafter runs this step,
# written before it does (`decisions.GATE_EVENT`); the others as DESIGN section 7.
# `storage`: the log's own files failed (a closed segment that could not be compressed stays plain).
EVENTS = frozenset({"job", "transition", "collective", "buffers", "graph", "fault", "stop", "injected", "gate",
                    "storage"})
STOP_SOURCES = ("signal", "shutdown")
# A transition's fields are a few names from small sets: each body is rendered once.
_TRANSITION_BODIES: dict[tuple[str, str, str, str], bytes] = {}


def _refuse_rendered(event: str) -> None:
    """A `rendered` record whose event is unknown, or whose body is not a JSON object as bytes."""
    if event not in EVENTS:
        raise ValueError(f"audit event must be one of {sorted(EVENTS)}, got {event!r}")
    raise ValueError(f"a rendered {event} record's fields must be a JSON object as bytes")


class _Records:
    """The typed records (DESIGN section 7); `_emit` says where a built record goes."""

    def _emit(self, event: str, step_id: int | None, fields: dict[str, Any] | bytes) -> None:
        raise NotImplementedError

    def _pin(self, step_id: int | None) -> None:
        raise NotImplementedError

    def transition(self, step_id: int | None, trigger: str, src: str, dst: str, outcome: str,
                   decided: tuple[int, dict | None] | None = None) -> None:
        """`decided`: (digest, changed decisions or None) of the step a `finish` ends (`decisions`)."""
        if decided is not None:
            fields = {"trigger": trigger, "src": src, "dst": dst, "outcome": outcome, DIGEST_FIELD: decided[0]}
            if decided[1]:
                fields[DECISIONS_FIELD] = decided[1]
            self._emit("transition", step_id, fields)
            return
        body = _TRANSITION_BODIES.get((trigger, src, dst, outcome))
        if body is None:
            body = compact.transition_body(trigger, src, dst, outcome)
            if len(_TRANSITION_BODIES) < 4096:
                _TRANSITION_BODIES[(trigger, src, dst, outcome)] = body
        self._emit("transition", step_id, body)

    def rendered_transition(self, step_id: int | None, body: bytes, tail: bytes) -> None:
        """A transition whose body is rendered already (`compact.transition_body`, outcome and
        all) followed by fields of its own, rendered too (`tail`: `,"key":value...`, e.g. the
        decisions a vLLM step's `finish` carries, `compact.decisions_tail`): the record
        `transition` writes with those fields, without a dict or an encoder call per record."""
        if type(body) is not bytes or body[:6] != b'{"tr":' or body[-1] != 125 or type(tail) is not bytes \
                or (tail and tail[0] != 44):
            raise ValueError("a rendered transition is a transition body and a ',\"key\":value' tail, as bytes")
        self._emit("transition", step_id, (body, tail))

    # `rendered(event, step_id, body)`: a record of `event` whose fields are rendered already, in
    # the compact encoding (`body` is one JSON object made by `compact.transition_body` or
    # `render.BuffersTemplate`, read back as the record its builder writes). Each
    # subclass writes it without the `_emit` hop: it runs two or three times a vLLM step, each
    # right after vLLM evicted the CPU caches.

    def collective(
        self,
        step_id: int | None,
        group: str,
        op: str,
        phase: int | None,
        shapes: Any,
        pg_seq: int | None,
        stage: str,
        **extra: Any,
    ) -> None:
        """`extra`: what the collective carried, e.g. the `sent` and `agreed` of an agreement."""
        if stage not in COLLECTIVE_STAGES:
            raise ValueError(f"collective stage must be one of {COLLECTIVE_STAGES}, got {stage!r}")
        if not _RESERVED.isdisjoint(extra):  # over `extra`'s keys: `keys() & _RESERVED` went over all 27 names
            raise ValueError(f"collective record: extra fields {sorted(extra.keys() & _RESERVED)} are reserved")
        self._emit("collective", step_id, {"group": group, "op": op, "phase": phase, "shapes": shapes,
                                           "pg_seq": pg_seq, "stage": stage, **extra})

    def buffers(self, step_id: int | None, reason: str, fingerprints: Mapping[str, Any]) -> None:
        self._emit("buffers", step_id, {"reason": reason, "buffers": snapshot(fingerprints)})

    def graph(self, step_id: int | None, action: str, **extra: Any) -> None:
        if action not in GRAPH_ACTIONS:
            raise ValueError(f"graph action must be one of {GRAPH_ACTIONS}, got {action!r}")
        if not _RESERVED.isdisjoint(extra):  # over `extra`'s keys: `keys() & _RESERVED` went over all 27 names
            raise ValueError(f"graph record: extra fields {sorted(extra.keys() & _RESERVED)} are reserved")
        self._emit("graph", step_id, {"action": action, **extra})

    def fault(self, step_id: int | None, error: str | BaseException, message: str) -> None:
        error_name = type(error).__name__ if isinstance(error, BaseException) else str(error)
        self._emit("fault", step_id, {"error": error_name, "message": str(message)})
        self._pin(step_id)  # a capped log keeps the segments that hold it, and the steps before it

    def gate(self, step_id: int | None, draft_steps: int) -> None:
        """The drafter's gate decided: `draft_steps` drafter steps run now (0: none this step)."""
        self._emit(GATE_EVENT, step_id, {GATE_FIELD: int(draft_steps)})

    def injected(self, step_id: int | None, injection: str) -> None:
        """An injected fault (`KIND@replica=R,step=S`) acts now: the evidence that it fired."""
        self._emit("injected", step_id, {"injection": str(injection), "kind": str(injection).partition("@")[0]})
        self._pin(step_id)  # a capped log keeps the segments that hold it, and the steps before it


class AuditBatch(_Records):
    """Records made now, written together by `write()` (see the module docstring). Each record
    keeps the time it was made; seq is given at `write()`, in the order the records were made."""

    def __init__(self, log: Any):
        self._log = log  # the `log.AuditLog` that writes it (not imported: `log` imports this module)
        self._pending: list[tuple[int, str, int | None, dict[str, Any]]] = []

    def _emit(self, event: str, step_id: int | None, fields: dict[str, Any] | bytes) -> None:
        self._pending.append((time.monotonic_ns(), event, step_id, fields))

    def rendered(self, event: str, step_id: int | None, body: bytes) -> None:
        """A record whose fields are rendered already (see `_Records`), collected: a vLLM
        step's end adds two or three, each right after vLLM's sampler evicted the CPU caches."""
        if event not in EVENTS or type(body) is not bytes or len(body) < 2 or body[0] != 123 or body[-1] != 125:
            _refuse_rendered(event)  # not a known event, or not a JSON object {...} as bytes
        self._pending.append((time.monotonic_ns(), event, step_id, body))

    def write(self) -> None:
        """Write what was collected (one write; nothing when empty) and start afresh."""
        pending = self._pending
        if pending:
            self._pending = []
            self._log._write_all(pending)

    def _pin(self, step_id: int | None) -> None:
        self._log.pin(step_id)
