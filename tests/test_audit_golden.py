"""Golden audit log: a fixed scripted run writes the same records twice.

Only time fields and buffer addresses may differ between two runs. Addresses are compared
by identity instead: each distinct `ptr` is replaced by the order in which it first
appears, so a buffer whose storage moved in one run and not the other still differs.
"""

import json

import pytest

from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.events import Capture, DummyStep, RealStep, Shutdown
from runner_fsm.testing.fakes import ScriptedPeers, busy_peer
from runner_fsm import dp
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch

pytestmark = pytest.mark.asyncio


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
        rec.pop("t_ns")
        for fp in rec.get("buffers", {}).values():
            fp["ptr"] = ptrs.setdefault(fp["ptr"], len(ptrs))
        out.append(rec)
    return out


async def test_two_runs_write_identical_logs(tmp_path):
    first = await _scripted_run(tmp_path / "a")
    second = await _scripted_run(tmp_path / "b")
    assert len(first) > 40
    assert _normalised(first) == _normalised(second)
    events = {json.loads(line)["event"] for line in first}
    assert events == {"transition", "collective", "buffers", "graph"}
