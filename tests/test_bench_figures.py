"""The benchmark figures report means over every step, the periodic ones included, and every
byte a step writes (Part 27, "Honest figures"): FSMWorker's own time per vLLM step
(benchmarks/bench_vllm_worker.py) is a mean over a whole number of the journal's batches, its
render steps in it, with the median beside it, and its ratio to vLLM's worker layer is of the
two means; bytes per decode step (benchmarks/bench_log_bytes.py) are the audit log's plus the
journal's beside it, at a batch of 32 requests. No vLLM needed: these are the helpers that turn
the timed steps and the written files into the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_vllm_worker as bench  # noqa: E402
from runner_fsm.integrations.vllm.recording.journal import BATCH  # noqa: E402


def test_the_window_is_a_whole_number_of_journal_batches():
    """Mutation seen to fail this: every step (70), or no steps below a batch."""
    assert BATCH == 32
    assert bench._window(70) == 64 and bench._window(64) == 64 and bench._window(96) == 96
    assert bench._window(20) == 20  # a run shorter than a batch: all its steps


def test_the_mean_keeps_the_render_step_the_median_leaves_out():
    """31 steps of 10 us and the step that renders the journal's batch, 330 us: the mean is
    20 us, the median 10 us. Mutation seen to fail this: the mean taken as the median."""
    steps = [10_000] * 31 + [330_000]
    got = bench._figures(steps, "wrapper_us")
    assert got["wrapper_us_mean"] == pytest.approx(20.0)
    assert got["wrapper_us_median"] == pytest.approx(10.0)
    assert got["wrapper_us_p99"] == pytest.approx(10.0) and got["wrapper_us_p90"] == pytest.approx(10.0)
    assert bench._figures(steps + [330_000] * 10, "x")["x_p99"] == pytest.approx(330.0)
    assert bench._figures([], "own_us") == {"own_us_mean": None, "own_us_median": None, "own_us_p90": None,
                                            "own_us_p99": None}


def test_the_split_by_call_is_means_per_step_that_add_up():
    """Each call's time over the window's steps, divided by the window: the calls' means add up
    to the step's mean; calls before the first step (-1) or past the window are left out.
    Mutation seen to fail this: dividing by the number of calls."""
    calls = {"execute_model": [(-1, 999_000), (0, 10_000), (1, 10_000), (1, 40_000), (2, 999_000)],
             "sample_tokens": [(0, 20_000), (1, 20_000)]}
    got = bench._by_call(calls, window=2)
    assert got["execute_model"]["mean"] == pytest.approx(30.0)  # (10 + 10 + 40) / 2 steps
    assert got["execute_model"]["median"] == pytest.approx(10.0)
    assert got["sample_tokens"]["mean"] == pytest.approx(20.0)
    step_means = bench._figures([30_000, 70_000], "s")["s_mean"]
    assert sum(f["mean"] for f in got.values()) == pytest.approx(step_means)


def _process(prefix: str, mean: float, median: float, steps: int = 70) -> dict:
    return {"steps": steps, "window_steps": bench._window(steps), "journal_renders_in_window": 2,
            f"{prefix}_mean": mean, f"{prefix}_median": median, f"{prefix}_p90": median * 2,
            f"{prefix}_p99": median * 3}


def test_the_own_time_row_gives_the_mean_first_and_a_ratio_of_means():
    """Two rounds; FSMWorker's medians are below vLLM's layer, its means above: the row says
    the mean first and judges the ratio of means (a miss). Mutation seen to fail this: the
    ratio or the figure of the medians (0.8x, a pass)."""
    runs = {"default": [_process("own_us", 40.0, 38.0), _process("own_us", 44.0, 40.0)],
            "fsm-transitions": [_process("wrapper_us", 48.0, 30.0), _process("wrapper_us", 44.0, 32.0)]}
    own = {"default": bench._pooled(runs["default"], "own_us")}
    wrapper = {"fsm-transitions": bench._pooled(runs["fsm-transitions"], "wrapper_us")}
    assert own["default"]["mean"] == pytest.approx(42.0) and wrapper["fsm-transitions"]["mean"] == pytest.approx(46.0)
    assert wrapper["fsm-transitions"]["median"] == pytest.approx(31.0)
    row = bench._own_time_row("audit=transitions", "fsm-transitions", runs, wrapper, own, "", None, "a note")
    assert row["figure"] == "46.0 us mean, 31.0 us median (thread CPU, paired)"
    assert row["baseline"] == "vLLM's worker layer 42.0 us mean, 39.0 us median"
    assert row["ratio"] == "1.10x [1.00-1.20]"  # 46/42; rounds 48/40 and 44/44
    assert row["status"] == "miss"
    assert "the first 64 of 70 steps of each process (2 journal batches, 2 renders), 2 processes" in row["note"]


def _lines(path: Path, records: list[dict]) -> list[int]:
    """Write `records` as JSON lines; the bytes each takes (its newline included)."""
    lines = [json.dumps(r, separators=(",", ":")) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return [len(line) + 1 for line in lines]


def _transition(step: int, trigger: str) -> dict:
    return {"event": "transition", "step_id": step, "trigger": trigger, "src": "ready", "dst": trigger}


def test_bytes_per_step_are_the_log_plus_the_journal_at_the_full_batch(tmp_path):
    """Bytes per decode step (benchmarks/bench_log_bytes.py): the log's records of the step and
    its journal entry's line, over the decode steps of `BATCH` requests or more (the tail, where
    requests finish, left out). Mutations seen to fail this: the journal's size over every step
    (the old "beside it" figure), the tail counted, the log alone in the figure."""
    import bench_log_bytes as logbytes

    log = _lines(tmp_path / "rank-0.jsonl", [
        {"event": "job", "step_id": -1}, _transition(0, "prefill"),
        _transition(1, "decode"), {"event": "buffers", "step_id": 1, "reason": "real", "pad": "x" * 40},
        _transition(2, "decode"), _transition(3, "decode")])
    journal = _lines(tmp_path / "vllm-steps-0.jsonl", [
        {"step": 0, "kind": "prefill", "sched": [20] * 32}, {"step": 1, "kind": "decode", "sched": [1] * 32},
        {"step": 2, "kind": "decode", "sched": [1] * 33, "sampled": [[5]] * 33},
        {"step": 3, "kind": "decode", "sched": [1] * 8}])
    got = logbytes.per_decode_step(tmp_path)
    assert got["counted_steps"] == 2 and got["decode_steps"] == 3 and got["batch"] == pytest.approx(32.5)
    assert got["bytes"] == pytest.approx((log[2] + log[3] + log[4]) / 2)
    assert got["records"] == pytest.approx(1.5)
    assert got["journal_bytes"] == pytest.approx((journal[1] + journal[2]) / 2)
    assert got["total_bytes"] == pytest.approx(got["bytes"] + got["journal_bytes"])
    text = logbytes.figure(got)
    assert text.startswith(f"{got['total_bytes']:,.0f} B/step: log {got['bytes']:,.0f} + journal"
                           f" {got['journal_bytes']:,.0f} (")
    with pytest.raises(SystemExit, match="no decode step of 64 requests or more"):
        logbytes.per_decode_step(tmp_path, batch=64)


def test_bytes_per_step_of_the_engine_read_its_batch_from_the_dp_agreement(tmp_path):
    """The embedded engine writes no journal: the batch is its DP agreement's `num_reqs`, and
    the figure says there is no journal."""
    import bench_log_bytes as logbytes

    def sync(step: int, reqs: int) -> dict:
        return {"event": "collective", "step_id": step, "group": "dp", "stage": "enqueue", "phase": 1,
                "sent": {"num_reqs": reqs}}

    log = _lines(tmp_path / "rank-0.jsonl", [sync(1, 32), _transition(1, "decode"),
                                             sync(2, 31), _transition(2, "decode")])
    got = logbytes.per_decode_step(tmp_path)
    assert got["counted_steps"] == 1 and got["journal_bytes"] == 0 and not got["journal"]
    assert got["bytes"] == pytest.approx(log[0] + log[1])
    assert logbytes.figure(got) == f"{log[0] + log[1]} B/step: log {log[0] + log[1]}, no journal (2.0 records)"
