"""Fault injection. Online: every process of a faulty run ends within a bounded time with a
typed error naming the culprit replica and step; the run exits non-zero. Offline: replay of
the run's logs names the same replica, step and kind of fault.

Each run is a real DP x PCP job (gloo processes) of the embedded engine with the tiny model and
a 3 s collective timeout. The culprit is replica 0 or the last replica. For most kinds it idles
from step 2 on (one short request) while another replica ("busy") still prefills and decodes,
and the fault hits it at step 4; wrong-dispatch-count and pcp-divergence need a real batch, so
there the culprit is the busy one (its prefill at step 0, its decode at step 4).
Offline, each run is judged twice: as written, and with every record of what the runner said
about itself removed (`fault` records, and records whose reason is `refused`).

The default suite runs every kind once at DP=2 (the culprit alternating between replica 0 and
replica 1) plus a few cases on both ends and at DP=3; `make test-slow` runs the whole matrix
(every kind, DP in {2, 3}, culprit replica 0 and the last replica).
"""

import time

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.config import ParallelLayout
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request
from runner_fsm.testing.logs import records_of, rewrite_in_full, write_in_full

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 3.0
BUSY_CULPRIT = {"wrong-dispatch-count": 0, "pcp-divergence": 4}  # kind -> step of its real batch
IDLE_STEP = 4


def workload(dp_size, busy):
    """Two long requests on replica `busy`, one short one (idle from step 2) on every other."""
    requests = [Request("long", tuple(range(5, 41)), 14, 0, replica=busy),
                Request("mid", tuple(range(50, 62)), 10, 1, replica=busy)]
    return requests + [Request(f"short-{r}", tuple(range(70, 75)), 2, 0, replica=r)
                       for r in range(dp_size) if r != busy]


def case(kind, dp_size, culprit):
    """(injection, busy replica, step) of `kind` on replica `culprit`."""
    if kind in BUSY_CULPRIT:
        step, busy = BUSY_CULPRIT[kind], culprit
    else:
        step, busy = IDLE_STEP, 0 if culprit == dp_size - 1 else dp_size - 1
    return f"{kind}@replica={culprit},step={step}", busy, step


def run_with_fault(models, run_dir, injection, layout, requests, **overrides):
    target, draft = models
    options = dict(layout=layout, num_speculative_tokens=1, collective_timeout_s=TIMEOUT_S)
    options.update(overrides)
    cfg = EngineConfig(model_dir=target, draft_dir=draft, run_dir=str(run_dir), injections=(injection,),
                       **options)
    start = time.monotonic()
    result = run_engine(cfg, requests, timeout_s=120)
    return result, time.monotonic() - start


# kind -> error types every rank may end with
ERRORS = {
    "skip-draft-sync": {"DesyncError"},
    "skip-dummy-forward": {"CollectiveTimeout"},
    "skip-buffer-refresh": {"StaleBufferError", "CollectiveTimeout"},
    "stale-pcp-context": {"StaleContextError", "CollectiveTimeout"},
    "wrong-dispatch-count": {"DispatchCountError"},
    "crash": {"ProcessDied", "CollectiveTimeout"},
    "hang": {"CollectiveTimeout"},
    "pcp-divergence": {"DesyncError", "CollectiveTimeout"},
    "draft-count-mismatch": {"CollectiveTimeout", "DesyncError"},
    "corrupt-agreement": {"DesyncError", "CollectiveTimeout"},
}
# One draft-decode forward needs K >= 2 speculative tokens.
OVERRIDES = {"draft-count-mismatch": {"num_speculative_tokens": 2}}
# A kind whose every rank stops on a typed error, no wait timed out, gets a watchdog it never
# needs: on a box loaded by other jobs (load 40) a rank once took more than 3 s to reach its first
# agreement, and wrong-dispatch-count's run ended in CollectiveTimeout instead.
for _kind, _errors in ERRORS.items():
    if "CollectiveTimeout" not in _errors:
        OVERRIDES.setdefault(_kind, {})["collective_timeout_s"] = 30.0


def culprit_text(kind, culprit, pcp_size):
    """What every peer's error must say about the culprit."""
    if kind == "wrong-dispatch-count":
        return (f"replica {culprit} (global rank {culprit * pcp_size}) sent 36 tokens to the DP agreement,"
                " but its batch dispatches 18")
    if kind == "skip-draft-sync":
        return f"culprit: replica {culprit} at step {IDLE_STEP}"
    return f"culprit: replica {culprit}"


def check_fault(models, tmp_path, kind, dp_size, pcp_size, culprit):
    injection, busy, step = case(kind, dp_size, culprit)
    run_dir = tmp_path / "run"
    result, elapsed = run_with_fault(models, run_dir, injection, ParallelLayout(dp_size, pcp_size),
                                     workload(dp_size, busy), **OVERRIDES.get(kind, {}))
    _check_online(kind, culprit, step, pcp_size, result, elapsed)
    _check_offline(kind, culprit, step, run_dir)
    removed = strip_runner_verdicts(run_dir, tmp_path / "stripped")
    assert removed > 0, f"{kind}: the run logged no fault record to remove"
    _check_offline(kind, culprit, step, tmp_path / "stripped")
    if kind == "stale-pcp-context":
        _check_context_evidence_missing(culprit, step, tmp_path / "stripped")
    return run_dir


def _check_context_evidence_missing(culprit, step, run_dir):
    """Without the context identity on the culprit's forward, replay cannot judge the context:
    no `stale_context`, but a `gap` naming the replica and step, never SOUND."""
    def without_ctx(records):
        for record in records:
            if record["event"] == "collective" and record["op"] == "forward" and record["dp_rank"] == culprit \
                    and record["step_id"] == step:
                del record["ctx"]
        return records
    for path in run_dir.glob("rank-*.jsonl"):
        rewrite_in_full(path, without_ctx)
    report = replay(run_dir)
    assert report.exit_code == 1 and not [v for v in report.verdicts if v.kind == "stale_context"], report.format()
    gaps = [v for v in report.verdicts if v.kind == "gap" and v.replica == culprit and v.step == step]
    assert gaps and "cannot be judged" in gaps[0].detail, report.format()


# The default suite: every kind at DP=2 x PCP=2, the culprit alternating between the two
# replicas, skip-draft-sync on both (the two-replica tie the order breaks), and DP=3 x PCP=1
# on replica 0 and the last replica for two kinds.
DEFAULT = [(kind, 2, 2, index % 2) for index, kind in enumerate(ERRORS)] + [
    ("skip-draft-sync", 2, 2, 1), ("skip-draft-sync", 3, 1, 0), ("stale-pcp-context", 3, 1, 2)]
assert ("skip-draft-sync", 2, 2, 0) in DEFAULT and ("stale-pcp-context", 2, 2, 1) in DEFAULT
MATRIX = [(kind, dp, 2, culprit) for dp in (2, 3) for kind in ERRORS for culprit in (0, dp - 1)]


def _ids(params):
    kind, dp, pcp, culprit = params
    return f"{kind}-dp{dp}xpcp{pcp}-replica{culprit}"


@pytest.mark.parametrize("params", DEFAULT, ids=_ids)
def test_fault_detected_online_and_offline(models, tmp_path, params):
    check_fault(models, tmp_path, *params)


@pytest.mark.slow
@pytest.mark.parametrize("params", [p for p in MATRIX if p not in DEFAULT], ids=_ids)
def test_fault_matrix_every_kind_both_ends_dp2_dp3(models, tmp_path, params):
    check_fault(models, tmp_path, *params)


def _check_online(kind, culprit, step, pcp_size, result, elapsed):
    assert not result.ok
    assert elapsed < 60, f"{kind}: took {elapsed:.0f} s"
    errors = {r.global_rank: r.error for r in result.ranks}
    assert all(errors.values()), f"{kind}: some rank ended without an error: {errors}"
    for rank, error in errors.items():
        assert error["type"] in ERRORS[kind], (kind, rank, error)
    text = culprit_text(kind, culprit, pcp_size)
    peers = [e for r, e in errors.items() if r // pcp_size != culprit]
    for error in peers:  # the peers learn who it was and where
        assert text in error["message"], (kind, error)
        assert f"step {step}" in error["message"] or error["step"] == step, (kind, error)


# kind -> the evidence kinds that may name the culprit, and a word its detail must carry.
# Never `fault`: replay must name each from what the ranks did, not from what they said.
OFFLINE = {
    "skip-draft-sync": ({"collective_mismatch"}, "DRAFT_PREFILL: 0 collectives where its peers ran"),
    "skip-dummy-forward": ({"collective_mismatch", "hang"}, "skipped expert forward TARGET"),
    "skip-buffer-refresh": ({"stale_buffer_replay"}, "not refreshed"),
    "stale-pcp-context": ({"stale_context"}, "used a real batch's PCP context built at step"),
    "wrong-dispatch-count": ({"dispatch_mismatch"}, "dispatches 18 tokens per PCP rank"),
    "crash": ({"hang", "missing_replica"}, "replica {culprit}"),
    "hang": ({"hang", "missing_replica"}, "replica {culprit}"),
    "pcp-divergence": ({"pcp_divergence"}, "sampled different tokens"),
    "draft-count-mismatch": ({"collective_mismatch"}, "DRAFT_DECODE: 0 collectives where its peers ran 1"),
    "corrupt-agreement": ({"agreed_mismatch"}, "num_tokens"),
}


def _check_offline(kind, culprit, step, run_dir):
    report = replay(run_dir)
    assert report.exit_code == 1
    kinds, word = OFFLINE[kind]
    word = word.format(culprit=culprit)
    named = [v for v in report.verdicts if v.replica == culprit and v.step == step and v.kind in kinds
             and word in v.detail]
    assert named, f"{kind}: no {kinds} verdict names replica {culprit} at step {step}:\n{report.format()}"
    if kind == "skip-draft-sync":  # the rule dp.agree applied online, applied to the logs
        assert f"culprit: replica {culprit} at step {step}" in named[0].detail, report.format()


def strip_runner_verdicts(run_dir, into) -> int:
    """Copy the run's logs without what the runner concluded about itself (`fault` records and
    records whose reason is `refused`), `seq` renumbered gapless: what the ranks did, without
    what the runner said about it. Returns the records removed."""
    into.mkdir()
    removed = 0
    for path in sorted(run_dir.glob("rank-*.jsonl")):
        kept = []
        for record in records_of(path):  # in full, whatever the encoding on disk
            if record["event"] == "fault" or record.get("reason") == "refused":
                removed += 1
                continue
            record["seq"] = len(kept)
            kept.append(record)
        write_in_full(into / path.name, kept)
    return removed
