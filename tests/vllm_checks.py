"""Helpers of the vLLM test files: reading a run's audit log and journal, replaying it."""

from __future__ import annotations

import json
from pathlib import Path


def records(run_dir, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / f"rank-{rank}.jsonl").read_text().splitlines()]


def transitions(run_dir, rank: int = 0) -> list[str]:
    return [r["trigger"] for r in records(run_dir, rank) if r["event"] == "transition"]


def assert_replays_sound(run_dir) -> None:
    from runner_fsm.audit.replay import replay

    report = replay(run_dir)
    assert report.sound, report.format()
