"""The recorder's step path: `begin_step`, the forward hook and `end_step`, compiled where built.

These three run once each per vLLM step (the hook once per forward), each right after vLLM's
own work evicted the CPU caches, where every Python frame and every object touched costs about
a microsecond. In Python, the path read some fifteen fields from the dicts of the recorder and
its state machine, through three frames. Compiled (`_step_core.c`), the same fields live in the
two objects' C structs (`StepCore`, `MachineCore`), a move is found by identity, and a step's
usual path runs no Python frame: the forward context is vLLM's, the two transitions the log's
compiled lane's (`audit.step_lane`), the digests `decisions.DECIDE`'s (docs/vllm.md, the sixth
pass). Everything else (a refused or new move, a step with records, a changed batch or
decision, the journal's render) calls what the Python path calls, in the same order.

`PyStepCore` below is the reference: the compiled one must leave the same records, journal
and fields for every step (tests/test_step_core.py runs both). The compiled one is a CPython
extension, built and stamped like the step lane (`compiled_parts`); `status()` says which one
runs and why. `RUNNER_FSM_NATIVE=0` turns it off (read when this module is imported).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from runner_fsm import compiled_parts
from runner_fsm.audit.compact import decisions_tail
from runner_fsm.audit.decisions import DECIDE, batch_identity, changed_since
from runner_fsm.integrations.vllm.recording import forwards
from runner_fsm.integrations.vllm.recording.forwards import forward_context
from runner_fsm.integrations.vllm.recording.journal import BATCH as JOURNAL_BATCH, Later
from runner_fsm.states import Trigger

STEP_TRIGGERS = {"prefill": Trigger.PREFILL, "decode": Trigger.DECODE, "idle": Trigger.IDLE}
_FINISH = Trigger.FINISH  # a module global: an enum member is a class lookup
NO_FORWARD = ("NONE", None)  # a step with no target forward: eager, no rows

SOURCE = Path(__file__).with_name("_step_core.c")
BUILD_ERROR = SOURCE.with_suffix(".build-error")  # left by setup.py where the build failed
MODULE = "runner_fsm.integrations.vllm.recording._step_core"


def changed_tail(digest: int, last: tuple | None, values: tuple) -> bytes:
    """A `finish` record's tail where a decision changed: the digest and the changes."""
    return decisions_tail(digest, changed_since(last, values))


def new_batch(keys: list, tokens: list) -> tuple[int, int]:
    """A real step's batch: its identity and the tokens scheduled."""
    return batch_identity(keys, tokens), sum(tokens)


class PyMachineCore:
    """`MachineCore`'s fields where it is not compiled: plain attributes of `StepMachine`."""

    now: Any
    moves: dict
    lane_write: Any


class PyStepCore:
    """The step path in Python, on the recorder's fields (`ReplicaRecorder.__init__` sets them):
    the reference of `_step_core.StepCore`, and what runs where it is not built."""

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
        machine, step = self.machine, self.step_id
        trigger = STEP_TRIGGERS[kind]
        move = machine.moves.get((machine.now, trigger))
        if move is not None and machine.lane_write is not None and machine.lane_write(step, move[1], b""):
            machine.now = move[0]
        else:
            machine.fire(trigger, step, lane=move is None)  # raises StepRefused: nothing changed
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
        tokens, digest, tail = DECIDE(values, sampled, self._last_values)
        self._decided_now = (*values, tokens)
        if tail is None:  # a decision changed (or the first step): the changes rendered too
            tail = changed_tail(digest, self._last_values, values)
            self._last_values = values
        step = self.step_id
        if self._forwards or drafted:
            self._end_with_records(step, drafted, tail)
        else:  # most steps: `finish` alone, no batch
            machine = self.machine
            move = machine.moves.get((machine.now, _FINISH))
            if move is not None and machine.lane_write is not None and machine.lane_write(step, move[1], tail):
                machine.now = move[0]
            else:
                machine.fire(_FINISH, step, None, tail, lane=move is None)
        self.kind = None
        self.step_id = step + 1
        if self.after_end is not None:
            self.after_end()


def load() -> tuple[ModuleType | None, str | None]:
    """The compiled module, configured, or None and why not."""
    if os.environ.get("RUNNER_FSM_NATIVE", "1") == "0":
        return None, "turned off by RUNNER_FSM_NATIVE=0"
    module, why_not = compiled_parts.load_extension(MODULE, SOURCE, BUILD_ERROR)
    if module is not None:
        module.configure(STEP_TRIGGERS, _FINISH, Later, DECIDE, changed_tail, new_batch, forward_context,
                         NO_FORWARD, JOURNAL_BATCH, forwards)
    return module, why_not


_compiled, _why_not = load()
StepCore: Any = _compiled.StepCore if _compiled is not None else PyStepCore
MachineCore: Any = _compiled.MachineCore if _compiled is not None else PyMachineCore


def status() -> dict:
    """For logs, tests and benchmarks: whether the step path runs compiled, and if not, why."""
    return {"compiled": True} if _compiled is not None else {"compiled": False, "reason": _why_not}
