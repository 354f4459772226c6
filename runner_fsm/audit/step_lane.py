"""The step lane's state, and its write compiled (`_step_lane.c`) where it is built.

A vLLM step writes two transitions (its start and its `finish`), each right after vLLM's own
work evicted the CPU caches. There, what a write costs is mostly the cache lines it touches:
the Python method (`AuditLog.step_transition`) reads and sets fields of the log, its lock, its
compact renderer, its mapped file and the file's map, five objects, and the compiled write of
the same fields as attributes still cost about as much (docs/vllm.md, the fourth pass). So the
fields a transition needs live in one object, `LaneState`:

- `seq`: the seq of the log's next record (`AuditLog`);
- `step`, `step_t`, `state`: the compact renderer's last step, the time of its first record
  and the last transition's `dst` (`CompactRenderer`);
- `room`: the mapped file's bytes mapped and not written yet, and the map itself, attached
  (`MappedFile`);
- `open`: whether the lane may write (the log's lane: compact, no segment switch due, open).

`LaneState.write(step_id, body, tail)` writes one transition as `AuditLog.step_transition`
does and returns True, or returns False having changed nothing, where that method must write
it (`StepMachine.fire` then calls it). The Python class below holds the same fields and never
writes (`write` is None): the method then writes every transition, the same bytes
(tests/test_step_lane_native.py).

The same module digests a step's decisions (`decide`: `decisions.decide` compiled, used once it
agreed with it; `decisions.DECIDE` is whichever runs).

The compiled one is a CPython extension, built like the compiled PCP layout
(`runner_fsm.pcp.native`): by the package's build where a C compiler and Python's headers are
(setup.py: pip install, wheels), in place by `make` in a checkout, stamped with the start of
its source's sha256; a module built from other source is not used. `status()` says which one
runs and why. `RUNNER_FSM_NATIVE=0` turns it off (read when this module is imported).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from runner_fsm import compiled_parts

SOURCE = Path(__file__).with_name("_step_lane.c")
BUILD_ERROR = SOURCE.with_suffix(".build-error")  # left by setup.py where the build failed
MODULE = "runner_fsm.audit._step_lane"


class PyLaneState:
    """`LaneState`'s fields, where the compiled one is not there: the Python method writes."""

    __slots__ = ("seq", "step", "step_t", "state", "room", "open")
    write = None  # every transition goes through `AuditLog.step_transition`
    attached = False

    def __init__(self, lock: Any = None, deferred: Any = None):
        self.seq, self.step, self.step_t, self.state, self.room, self.open = 0, _new_step, 0, None, 0, False

    def attach(self, mapping: Any) -> None:
        """The compiled one holds the map (its buffer); here the file writes into it itself."""

    def detach(self) -> None:
        pass


_new_step: Any = None  # compact._NEW_STEP, once `configure` has run


def source_digest() -> str:
    """The stamp of a module built from `SOURCE` (setup.py and the Makefile compute it too)."""
    return compiled_parts.source_digest(SOURCE)


def load() -> tuple[ModuleType | None, str | None]:
    """The compiled module, or None and why not."""
    if os.environ.get("RUNNER_FSM_NATIVE", "1") == "0":
        return None, "turned off by RUNNER_FSM_NATIVE=0"
    return compiled_parts.load_extension(MODULE, SOURCE, BUILD_ERROR)


_compiled, _why_not = load()
LaneState: Any = _compiled.LaneState if _compiled is not None else PyLaneState
# `decisions.decide` compiled (a step's digests and `finish` tail), None where not built;
# `decisions` checks it against its own before using it
decide: Any = _compiled.decide if _compiled is not None else None


def configure(edges: dict, new_step: Any) -> None:
    """`compact._EDGES` (transition body -> (src, dst, short body)) and `compact._NEW_STEP`,
    once, by `compact` itself (this module imports nothing of the audit package)."""
    global _new_step
    _new_step = new_step
    if _compiled is not None:
        _compiled.configure(edges, new_step)


def status() -> dict:
    """For logs, tests and benchmarks: whether the lane writes compiled, and if not, why."""
    return {"compiled": True} if _compiled is not None else {"compiled": False, "reason": _why_not}
