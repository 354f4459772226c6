"""`stale_context` judged from the identities on the forward's record, and what replay does
when they are missing: a forward of a writer that logs them, without a complete pair, is a
`gap` naming the replica and step (unjudged is never sound). A writer that logs no identity
on any forward (the vLLM worker, the synthetic logs) is not judged for `stale_context`.

Synthetic runs (no processes): `testing.synth` logs, their target forwards given the
identities the embedded runner writes.
"""

from __future__ import annotations

import orjson

from runner_fsm.replay.judge import replay
from runner_fsm.replica.evidence import identity
from runner_fsm.testing.synth import SynthSpec, write_run

SPEC = SynthSpec(dp_size=3, pcp_size=2, graphs=False)


def _with_identities(run_dir, edit=lambda record, replica, step: record):
    """Give every target forward of the run its `ctx` and `batch` identities (sound ones), then
    let `edit(record, replica, step)` change them."""
    for path in run_dir.glob("rank-*.jsonl"):
        lines = []
        for line in path.read_bytes().splitlines():
            record = orjson.loads(line)
            if record["event"] == "collective" and record["op"] == "forward" and record["stage"] == "enqueue":
                step, rows = record["step_id"], record["shapes"][0][0]
                record["ctx"] = record["batch"] = identity(step, False, rows, 1000 + step)
                record = edit(record, record["dp_rank"], step)
            lines.append(orjson.dumps(record))
        path.write_bytes(b"".join(line + b"\n" for line in lines))
    return run_dir


def test_complete_identities_are_sound(tmp_path):
    report = replay(_with_identities(write_run(tmp_path / "run", SPEC)))
    assert report.sound, report.format()


def _at(replica, step, change):
    def edit(record, at_replica, at_step):
        if (at_replica, at_step) == (replica, step):
            change(record)
        return record
    return edit


def test_a_context_built_for_another_step_is_stale_on_either_end(tmp_path):
    for culprit in (0, SPEC.dp_size - 1):
        def older(record):
            record["ctx"] = dict(record["ctx"], step=3, digest=1003)
        report = replay(_with_identities(write_run(tmp_path / str(culprit), SPEC), _at(culprit, 5, older)))
        [verdict] = report.verdicts
        assert (verdict.kind, verdict.replica, verdict.step) == ("stale_context", culprit, 5), report.format()
        assert "built at step 3" in verdict.detail


def test_a_context_with_another_digest_is_stale(tmp_path):
    def forged(record):
        record["ctx"] = dict(record["ctx"], digest=7)  # right step and rows, other arrays
    report = replay(_with_identities(write_run(tmp_path / "run", SPEC), _at(2, 4, forged)))
    [verdict] = report.verdicts
    assert (verdict.kind, verdict.replica, verdict.step) == ("stale_context", 2, 4), report.format()
    assert "digests differ" in verdict.detail


def test_a_forward_without_its_context_identity_is_a_gap_not_sound(tmp_path):
    for culprit in (0, SPEC.dp_size - 1):
        report = replay(_with_identities(write_run(tmp_path / str(culprit), SPEC),
                                         _at(culprit, 5, lambda record: record.pop("ctx"))))
        assert not report.sound and report.exit_code == 1
        assert {(v.kind, v.replica, v.step) for v in report.verdicts} == {("gap", culprit, 5)}, report.format()
        assert all("logged no `ctx` identity" in v.detail and "cannot be judged" in v.detail for v in report.verdicts)


def test_an_identity_without_digest_is_a_gap(tmp_path):
    def old_format(record):
        del record["ctx"]["digest"]
    report = replay(_with_identities(write_run(tmp_path / "run", SPEC), _at(1, 6, old_format)))
    assert {(v.kind, v.replica, v.step) for v in report.verdicts} == {("gap", 1, 6)}, report.format()
    assert "its `ctx` identity lacks digest" in report.verdicts[0].detail


def test_a_writer_that_logs_no_identity_is_not_judged(tmp_path):
    # what the vLLM worker writes today: no verdict either way (docs/audit.md: not judged)
    report = replay(write_run(tmp_path / "run", SPEC))
    assert report.sound, report.format()
