"""Golden audit log: a fixed scripted run must write the records stored in
tests/golden/scripted-rank-0.jsonl, record for record.

Only fields that legitimately vary between runs are left out of the comparison: `t_ns` (a
monotonic clock), each buffer's `ptr` (where the allocator put it), and the `job` record's `host`
and `pid` (checked for their types, then fixed). Addresses are compared
by identity instead: each distinct `ptr` is replaced by the order in which it first appears,
so a buffer whose storage moved still differs. The run id is fixed by the script ("golden").
Everything else (seq, event, step, every field, content digests) must be equal.

When the log format changes on purpose, regenerate the file and review its diff:

    RUNNER_FSM_REGENERATE_GOLDEN=1 python -m pytest tests/test_audit_golden.py
"""

import json
import os
from pathlib import Path

import pytest

from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.events import Capture, DummyStep, RealStep, Shutdown
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer
from runner_fsm import dp
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch

pytestmark = pytest.mark.asyncio

GOLDEN = Path(__file__).parent / "golden" / "scripted-rank-0.jsonl"
REGENERATE = os.environ.get("RUNNER_FSM_REGENERATE_GOLDEN") == "1"
VARYING = ("t_ns",)  # besides `ptr`, normalised below


async def _scripted_run(run_dir):
    cfg = RunnerConfig(layout=ParallelLayout(dp_size=2), graph_mode=GraphMode.FULL_DECODE_ONLY,
                       num_speculative_tokens=2, max_num_tokens=64, capture_sizes=(1, 2, 4, 8))
    runner = make_runner(cfg, ScriptedPeers(busy_peer(2, dp.GRAPH_FULL, 1), cfg.capture_sizes),
                         run_dir=run_dir, run_id="golden")
    for event in (Capture(), RealStep(prefill_batch([6, 3])), RealStep(decode_batch([6, 3])),
                  DummyStep(), RealStep(decode_batch([7, 4], num_draft_tokens=[2, 2])), Shutdown("done")):
        await runner.handle(event)
    await runner.close()
    return (run_dir / "rank-0.jsonl").read_text().splitlines()


def _normalised(lines):
    ptrs = {}
    out = []
    for line in lines:
        rec = json.loads(line)
        for name in VARYING:
            rec.pop(name)
        if rec["event"] == "job":
            assert isinstance(rec.pop("host"), str) and isinstance(rec.pop("pid"), int)
            rec.update(host="<host>", pid=0)
        for fp in rec.get("buffers", {}).values():
            fp["ptr"] = ptrs.setdefault(fp["ptr"], len(ptrs))
        out.append(rec)
    return out


async def test_the_scripted_run_writes_the_golden_log(tmp_path):
    lines = await _scripted_run(tmp_path / "a")
    if REGENERATE:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("".join(json.dumps(rec, sort_keys=True) + "\n" for rec in _normalised(lines)))
    golden = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    got = _normalised(lines)
    for index, (want, have) in enumerate(zip(golden, got)):
        assert have == want, f"record {index} (seq {want.get('seq')}) differs from {GOLDEN.name}"
    assert len(got) == len(golden), f"{len(got)} records, the golden log has {len(golden)}"
    assert {rec["event"] for rec in golden} == {"job", "transition", "collective", "buffers", "graph"}


async def test_the_comparison_sees_a_changed_field(tmp_path):
    lines = await _scripted_run(tmp_path / "a")
    record = json.loads(lines[5])
    record["step_id"] = 99
    lines[5] = json.dumps(record)
    golden = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    assert _normalised(lines) != golden
