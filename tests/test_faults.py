"""Fault injection. Online: every process of a faulty run ends within a bounded time with a
typed error naming the culprit replica and step; the run exits non-zero. Offline: replay of
the run's logs names the same replica, step and kind of fault.

Each test is a real DP=2 x PCP=2 run (4 processes on gloo) of the embedded engine with the
tiny model and a 3 s collective timeout. Replica 1 owns one short request and idles from
step 2 on while replica 0 still prefills and decodes; faults hit replica 1 at step 4
(wrong-dispatch-count hits replica 0's prefill at step 0, pcp-divergence its decode at step 4).
Offline, each run is judged twice: as written, and with every `fault` record removed.
"""

import time

import orjson
import pytest

from runner_fsm.audit.replay import replay
from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 3.0
WORKLOAD = [
    Request("long", tuple(range(5, 41)), 14, 0, replica=0),
    Request("mid", tuple(range(50, 62)), 10, 1, replica=0),
    Request("short", tuple(range(70, 75)), 2, 0, replica=1),
]


def run_with_fault(models, run_dir, injection, **overrides):
    target, draft = models
    options = dict(layout=ParallelLayout(2, 2), num_speculative_tokens=1, collective_timeout_s=TIMEOUT_S)
    options.update(overrides)
    cfg = EngineConfig(model_dir=target, draft_dir=draft, run_dir=str(run_dir), injections=(injection,),
                       **options)
    start = time.monotonic()
    result = run_engine(cfg, WORKLOAD, timeout_s=120)
    return result, time.monotonic() - start


# kind -> (injection, error types every rank may end with, text naming the culprit)
CASES = {
    "skip-draft-sync": ("skip-draft-sync@replica=1,step=4", {"DesyncError"}, "odd one(s) out: replica(s) 1"),
    "skip-dummy-forward": ("skip-dummy-forward@replica=1,step=4", {"CollectiveTimeout"}, "culprit: replica 1"),
    "skip-buffer-refresh": ("skip-buffer-refresh@replica=1,step=4", {"StaleBufferError", "CollectiveTimeout"},
                            "culprit: replica 1"),
    "stale-pcp-context": ("stale-pcp-context@replica=1,step=4", {"StaleContextError", "CollectiveTimeout"},
                          "culprit: replica 1"),
    "wrong-dispatch-count": ("wrong-dispatch-count@replica=0,step=0", {"DispatchCountError"},
                             "replica 0 (global rank 0) sent 36 tokens to the DP agreement, but its batch dispatches 18"),
    "crash": ("crash@replica=1,step=4", {"ProcessDied", "CollectiveTimeout"}, "culprit: replica 1"),
    "hang": ("hang@replica=1,step=4", {"CollectiveTimeout"}, "culprit: replica 1"),
    "pcp-divergence": ("pcp-divergence@replica=0,step=4", {"DesyncError", "CollectiveTimeout"},
                       "culprit: replica 0"),
    "draft-count-mismatch": ("draft-count-mismatch@replica=1,step=4", {"CollectiveTimeout", "DesyncError"},
                             "culprit: replica 1"),
    "corrupt-agreement": ("corrupt-agreement@replica=1,step=4", {"DesyncError", "CollectiveTimeout"},
                          "culprit: replica 1"),
}
# One draft-decode forward needs K >= 2 speculative tokens.
OVERRIDES = {"draft-count-mismatch": {"num_speculative_tokens": 2}}


@pytest.mark.parametrize("kind", list(CASES))
def test_fault_detected_online_and_offline(models, tmp_path, kind):
    injection, types, culprit_text = CASES[kind]
    run_dir = tmp_path / "run"
    result, elapsed = run_with_fault(models, run_dir, injection, **OVERRIDES.get(kind, {}))
    _check_online(kind, injection, types, culprit_text, result, elapsed)
    _check_offline(kind, injection, run_dir)
    removed = strip_fault_records(run_dir, tmp_path / "no-faults")
    assert removed > 0, f"{kind}: the run logged no fault record to remove"
    _check_offline(kind, injection, tmp_path / "no-faults")


def _check_online(kind, injection, types, culprit_text, result, elapsed):
    assert not result.ok
    assert elapsed < 60, f"{kind}: took {elapsed:.0f} s"
    errors = {r.global_rank: r.error for r in result.ranks}
    assert all(errors.values()), f"{kind}: some rank ended without an error: {errors}"
    for rank, error in errors.items():
        assert error["type"] in types, (kind, rank, error)
    step = int(injection.rsplit("step=", 1)[1])
    culprit = int(injection.split("replica=")[1].split(",")[0])
    peers = [e for r, e in errors.items() if r // 2 != culprit]
    for error in peers:  # the peers learn who it was and where
        assert culprit_text in error["message"], (kind, error)
        assert f"step {step}" in error["message"] or error["step"] == step, (kind, error)


# kind -> the evidence kinds that may name the culprit, and a word its detail must carry.
# Never `fault`: replay must name each from what the ranks did, not from what they said.
OFFLINE = {
    "skip-draft-sync": ({"collective_mismatch"}, "DRAFT_PREFILL: 0 collectives where its peers ran"),
    "skip-dummy-forward": ({"collective_mismatch", "hang"}, "skipped expert forward TARGET"),
    "skip-buffer-refresh": ({"stale_buffer_replay"}, "not refreshed"),
    "stale-pcp-context": ({"stale_context"}, "used a real batch's PCP context built at step"),
    "wrong-dispatch-count": ({"dispatch_mismatch"}, "dispatches 18 tokens per PCP rank"),
    "crash": ({"hang", "missing_replica"}, "replica 1"),
    "hang": ({"hang", "missing_replica"}, "replica 1"),
    "pcp-divergence": ({"pcp_divergence"}, "sampled different tokens"),
    "draft-count-mismatch": ({"collective_mismatch"}, "DRAFT_DECODE: 0 collectives where its peers ran 1"),
    "corrupt-agreement": ({"agreed_mismatch"}, "num_tokens"),
}


def _check_offline(kind, injection, run_dir):
    step = int(injection.rsplit("step=", 1)[1])
    culprit = int(injection.split("replica=")[1].split(",")[0])
    report = replay(run_dir)
    assert report.exit_code == 1
    kinds, word = OFFLINE[kind]
    named = [v for v in report.verdicts if v.replica == culprit and v.step == step and v.kind in kinds
             and word in v.detail]
    assert named, f"{kind}: no {kinds} verdict names replica {culprit} at step {step}:\n{report.format()}"


def strip_fault_records(run_dir, into) -> int:
    """Copy the run's logs without their `fault` records, `seq` renumbered gapless: what the
    ranks did, without what the runner said about it. Returns the records removed."""
    into.mkdir()
    removed = 0
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        kept = []
        for line in path.read_bytes().splitlines():
            if not line.strip():  # the blank tail of a log its process never closed
                continue
            record = orjson.loads(line)
            if record["event"] == "fault":
                removed += 1
                continue
            record["seq"] = len(kept)
            kept.append(orjson.dumps(record))
        (into / path.name).write_bytes(b"".join(line + b"\n" for line in kept))
    return removed
