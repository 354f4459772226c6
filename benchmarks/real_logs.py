"""Audit logs written by a real run, and the same logs grown to any length by tiling.

`write_real_run` serves a workload with the embedded engine (DP x PCP processes on gloo, the
tiny random Mixtral of the tests with its drafter, graph replays on uniform decode steps):
every record is the runner's own.
`tile_run` repeats the run's complete steps until the logs hold `steps` steps: step ids,
`seq`, `pg_seq` and the step ids inside the records are shifted, everything else is kept as
the runner wrote it, so a replay of the tiled logs reads the real records, at any length.
`per_step` counts records and bytes per step of a run's logs.

    PYTHONPATH=. .venv/bin/python benchmarks/real_logs.py            # records and bytes per step
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson


def write_real_run(run_dir: Path, *, dp: int = 4, pcp: int = 2, requests: int = 24,
                   graphs: bool = True, arrival_every: int = 1, max_num_reqs: int = 16,
                   capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), max_new_tokens: int = 12) -> None:
    """`requests` of `max_new_tokens` arrive one every `arrival_every` steps (0: all at once), at
    most `max_num_reqs` in a replica's batch; graphs captured at `capture_sizes` tokens."""
    from runner_fsm.config import GraphMode, ParallelLayout
    from runner_fsm.engine.api import run_engine
    from runner_fsm.engine.config import EngineConfig
    from runner_fsm.engine.requests import synthetic_requests
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    models = Path(run_dir).parent / "models"
    if not models.exists():  # the tiny random Mixtral target and draft of the tests
        make_random_model(models / "target", TARGET_SPEC, seed=11)
        make_random_model(models / "draft", DRAFT_SPEC, seed=12)
    cfg = EngineConfig(model_dir=str(models / "target"), draft_dir=str(models / "draft"), run_dir=str(run_dir),
                       layout=ParallelLayout(dp, pcp), num_speculative_tokens=1, collective_timeout_s=60,
                       graph_mode=GraphMode.FULL_DECODE_ONLY if graphs else GraphMode.NONE,
                       max_num_reqs=max_num_reqs, capture_sizes=capture_sizes)
    work = synthetic_requests(requests, vocab_size=64, max_new_tokens=max_new_tokens,
                              arrival_every=arrival_every)
    result = run_engine(cfg, work, timeout_s=600)
    if not result.ok:
        raise RuntimeError(f"the real run failed: {[r.error for r in result.ranks if r.error]}")


def per_step(run_dir: Path) -> dict:
    """Records and bytes per step and rank, over the steps of the run (capture excluded): each
    record's line on disk (compact, `runner_fsm.audit.compact`), its step read in full."""
    from runner_fsm.audit import read_records

    records = size = 0
    steps = set()
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        for line, record in zip(path.read_bytes().splitlines(), read_records(path)):
            if isinstance(record["step_id"], int) and record["step_id"] >= 0:
                records += 1
                size += len(line) + 1
                steps.add((path.name, record["step_id"]))
    return {"records_per_step": records / len(steps), "bytes_per_step": size / len(steps),
            "rank_steps": len(steps)}


def _shift_steps(record: dict, delta: int) -> None:
    record["step_id"] += delta
    for key in ("sent", "agreed"):
        value = record.get(key)
        if isinstance(value, dict) and isinstance(value.get("step_id"), int):
            value["step_id"] += delta
    for key in ("ctx", "batch"):
        value = record.get(key)
        if isinstance(value, dict):
            value["step"] += delta


def tile_run(source: Path, into: Path, steps: int) -> None:
    """`into`: the run of `source` with its complete steps repeated up to `steps` steps (its
    records read in full, `read_records`, and written in full: a log replay reads as any)."""
    from runner_fsm.audit import read_records
    from runner_fsm.audit.compact import FORMAT_FIELD

    into.mkdir(parents=True)
    for path in sorted(source.glob("rank-*.jsonl")):
        lines = [r for r in read_records(path)]
        lines[0].pop(FORMAT_FIELD, None)
        last = max(r["step_id"] for r in lines if isinstance(r["step_id"], int))
        head = [r for r in lines if not isinstance(r["step_id"], int) or r["step_id"] < 0]
        body = [r for r in lines if isinstance(r["step_id"], int) and 0 <= r["step_id"] < last]
        tail = [r for r in lines if r["step_id"] == last]
        period = last  # steps 0 .. last-1 repeat; the last step (the shutdown) ends the run
        pg_period: dict[str, int] = {}
        for r in body:
            if r["event"] == "collective" and r["stage"] == "enqueue":
                pg_period[r["group"]] = pg_period.get(r["group"], 0) + 1
        seq = 0
        with open(into / path.name, "wb") as out:
            def emit(record: dict, delta: int, tile: int) -> None:
                nonlocal seq
                record = dict(record)  # a private copy of what is shifted
                for key in ("sent", "agreed", "ctx", "batch"):
                    if isinstance(record.get(key), dict):
                        record[key] = dict(record[key])
                record["seq"] = seq
                seq += 1
                if isinstance(record["step_id"], int) and record["step_id"] >= 0:
                    _shift_steps(record, delta)
                if record["event"] == "collective" and record.get("pg_seq") is not None:
                    record["pg_seq"] += tile * pg_period.get(record["group"], 0)
                out.write(orjson.dumps(record) + b"\n")

            for r in head:
                emit(r, 0, 0)
            tiles = max(1, (steps - 1) // period)
            for tile in range(tiles):
                for r in body:
                    emit(r, tile * period, tile)
            for r in tail:
                emit(r, (tiles - 1) * period, tiles - 1)


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="real-logs-") as base:
        run = Path(base) / "run"
        write_real_run(run)
        print(per_step(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
