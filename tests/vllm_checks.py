"""Helpers of the vLLM test files: reading a run's audit log and journal, replaying it."""

from __future__ import annotations

from pathlib import Path

from runner_fsm.audit import read_records


def records(run_dir, rank: int = 0) -> list[dict]:
    """The rank's records (a log its process never closed ends in blank lines: skipped)."""
    return list(read_records(Path(run_dir) / f"rank-{rank}.jsonl"))


def transitions(run_dir, rank: int = 0) -> list[str]:
    return [r["trigger"] for r in records(run_dir, rank) if r["event"] == "transition"]


def assert_replays_sound(run_dir):
    from runner_fsm.audit.replay import replay

    report = replay(run_dir)
    assert report.sound, report.format()
    return report
