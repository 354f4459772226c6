"""The benchmark figures report means over every step, the periodic ones included (Part 27,
"Honest figures"): FSMWorker's own time per vLLM step (benchmarks/bench_vllm_worker.py) is a
mean over a whole number of the journal's batches, its render steps in it, with the median
beside it, and its ratio to vLLM's worker layer is of the two means. No vLLM needed: these
are the helpers that turn the timed steps into the row."""

from __future__ import annotations

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
