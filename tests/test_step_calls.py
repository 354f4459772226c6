"""FSMWorker's decode step at `audit=transitions` runs through a budget of Python calls
(`benchmarks/step_calls.py` counts them; each costs a microsecond or two right after vLLM's
work evicted the CPU caches, and a timing cannot show one more on a shared machine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_calls import count  # noqa: E402

# 2026-12-05: 4 with the recorder's step path compiled (8 with the digests inline and the recorder's
# hook, 16 with the compiled step lane, 22 before it)
BUDGET = 4


def test_a_decode_step_stays_within_its_call_budget():
    """Both transitions are written by the compiled step lane (`LaneState.write`: neither
    `AuditLog.step_transition` nor the general path), two records a step, and the step makes at
    most `BUDGET` Python calls. Mutations seen to fail this: `StepMachine.fire` not asking the
    lane (`AuditLog.step_transition` called); the worker's general forward hook registered at
    `transitions` (7 calls); the compiled `end_step` rendering the tail of an unchanged step in
    Python (`changed_tail`, 5 calls); the compiled step path not built (its reference's 8)."""
    result = count(steps=10)
    functions = result["functions"]
    assert result["lane"] == {"compiled": True}, result["lane"]  # make builds them: a missing one fails
    assert result["core"] == {"compiled": True}, result["core"]
    assert result["records"] == 2
    assert "AuditLog.step_transition" not in functions
    assert "AuditLog._write_all" not in functions and "AuditBatch.write" not in functions
    assert result["calls"] <= BUDGET, "\n".join(f"{name}: {calls:.1f}" for name, (calls, _) in functions.items())
