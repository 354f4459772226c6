"""FSMWorker's decode step at `audit=transitions` runs through a budget of Python calls
(`benchmarks/step_calls.py` counts them; each costs a microsecond or two right after vLLM's
work evicted the CPU caches, and a timing cannot show one more on a shared machine). The count
is a mean over whole journal batches, the journal's render included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_calls import count  # noqa: E402

# 2026-12-06: 24.06 measured over 64 steps (the Python step path: the compiled one is retired);
# then 26.06: the journal's entries written as their differences from the one before (format 2,
# `journal_encoder`: `Encoder.line` and its steady path, two calls a step), which halves the
# journal's bytes a step so that it costs no more than the log beside it (issue 53)
BUDGET = 26.1


def test_a_decode_step_stays_within_its_call_budget():
    """Both transitions take the short path (`AuditLog.step_transition`, not the general
    `_write_all`/`AuditBatch.write`), two records a step, and the step makes at most `BUDGET`
    Python calls on average."""
    result = count(steps=64)
    functions = result["functions"]
    assert result["records"] == 2
    assert functions["AuditLog.step_transition"][0] == 2
    assert "AuditLog._write_all" not in functions and "AuditBatch.write" not in functions
    assert any(name.startswith("Journal.render") for name in functions), "the window must hold a render"
    assert result["calls"] <= BUDGET, "\n".join(f"{name}: {calls:.1f}" for name, (calls, _) in functions.items())


def test_a_window_that_leaves_the_journal_render_out_is_refused():
    with pytest.raises(ValueError, match="multiple of the journal's batch"):
        count(steps=20)
