"""`runner-fsm replay` on synthetic logs: each injected defect is named with its replica and step."""

import dataclasses

import pytest

from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

SPEC = SynthSpec(dp_size=3, pcp_size=2, steps=10, spec_tokens=2)

# defect -> the kinds of verdict it must produce, no more and no fewer
EXPECTED_KINDS = {
    "gap": {"gap"},
    "missing_replica": {"missing_replica"},
    "agreed_mismatch": {"agreed_mismatch"},
    "pg_seq": {"gap", "agreed_mismatch"},  # the unlogged collective is seen locally and across ranks
    "collective_mismatch": {"collective_mismatch"},
    "skip_dummy_forward": {"collective_mismatch"},
    "illegal_transition": {"illegal_transition"},
    "stale_buffer_replay": {"stale_buffer_replay"},
    "moved_buffer": {"stale_buffer_replay"},
    "hang": {"hang"},
    "deadlock": {"hang"},  # each side waits for the other: one finding, naming the one that skipped
    "truncated": {"gap", "hang"},
    "fault": {"fault"},
}
# the verdict kind that must name the defect's replica and step
NAMING_KIND = {"pg_seq": "agreed_mismatch", "moved_buffer": "stale_buffer_replay", "truncated": "gap",
               "skip_dummy_forward": "collective_mismatch", "deadlock": "hang"}


def _judge(tmp_path, spec=SPEC, defects=()):
    return replay(write_run(tmp_path / "run", spec, defects))


def test_sound_synthetic_run_has_no_findings(tmp_path):
    report = _judge(tmp_path)
    assert report.sound and report.exit_code == 0, report.format()
    assert report.summary.ranks == 6 and report.summary.last_step == SPEC.steps - 1
    assert report.summary.records > 6 * SPEC.steps * 8


@pytest.mark.parametrize("spec", [
    SynthSpec(spec_tokens=0, graphs=False),
    SynthSpec(spec_tokens=1, log_agreed=False, log_sent=False, expert_collectives=False),
    SynthSpec(dp_size=2, pcp_size=4, model_collectives=True),
    SynthSpec(dp_size=1, pcp_size=1),
], ids=["eager-no-draft", "no-agreed-field", "pcp-collectives", "single-rank"])
def test_sound_variants_have_no_findings(tmp_path, spec):
    report = _judge(tmp_path, spec)
    assert report.sound, report.format()


@pytest.mark.parametrize("replica,step", [(2, 5), (0, 3)])
@pytest.mark.parametrize("kind", sorted(EXPECTED_KINDS))
def test_each_defect_is_named_with_replica_and_step(tmp_path, kind, replica, step):
    report = _judge(tmp_path, defects=[Defect(kind, replica, step)])
    assert report.exit_code == 1
    assert set(report.counts()) == EXPECTED_KINDS[kind], report.format()
    naming = NAMING_KIND.get(kind, kind)
    named = [v for v in report.verdicts if v.kind == naming]
    assert named, report.format()
    if kind == "truncated":  # the record lost is the first of `step`: the gap sits at its end
        assert (named[0].replica, named[0].step) == (replica, step - 1), report.format()
    else:
        assert (named[0].replica, named[0].step) == (replica, step), report.format()
    assert report.verdicts[0].replica == replica, report.format()


def test_a_skipped_collective_is_one_verdict_not_one_per_later_step(tmp_path):
    report = _judge(tmp_path, SynthSpec(dp_size=2, steps=40), [Defect("collective_mismatch", 1, 4)])
    (verdict,) = report.verdicts
    assert (verdict.kind, verdict.replica, verdict.step, verdict.ranks) == ("collective_mismatch", 1, 4, (2, 3))
    assert verdict.detail == (
        "replica 1 skipped all_reduce DRAFT_PREFILL [[14]] that its peers issued (DRAFT_PREFILL: 0"
        " collectives where its peers ran 1) in group 'dp'; and skipped draft_prefill DRAFT_PREFILL that its"
        " peers issued (DRAFT_PREFILL: 0 collectives where its peers ran 1) in group 'expert' at step 4"
        # the same finding from the agreement both met (rules.pairing, by the rule of dp.agree)
        "; and replica 1: its DP agreement met its peers' with another step or phase (replica 0 sent step 4"
        " DRAFT_PREFILL, replica 1 sent step 5 TARGET): culprit: replica 1 at step 4 (no majority; it is"
        " ahead in (step, phase, sequence) order: it skipped a collective its peers are still in); expected"
        " step 4 DRAFT_PREFILL, odd one(s) out: replica(s) 1")


def test_tie_between_two_replicas_names_the_one_that_skipped(tmp_path):
    # dp_size 2: one sequence each; the run's template (every other step) breaks the tie
    for culprit in (0, 1):
        report = _judge(tmp_path / str(culprit), SynthSpec(dp_size=2, pcp_size=1),
                        [Defect("collective_mismatch", culprit, 3)])
        assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("collective_mismatch", culprit, 3)]


def test_hang_names_the_replica_that_never_arrived_and_the_collective(tmp_path):
    report = _judge(tmp_path, defects=[Defect("hang", 1, 6)])
    (verdict,) = report.verdicts
    assert (verdict.kind, verdict.replica, verdict.step, verdict.ranks) == ("hang", 1, 6, (2, 3))
    assert "dp all_reduce TARGET" in verdict.detail and "pg_seq 18" in verdict.detail
    assert "to blame: replica 1 (its log ends at step 5)" in verdict.detail
    assert verdict.detail.startswith("replica(s) 0, 2 stopped waiting")


def test_deadlock_names_the_replica_that_skipped_ahead(tmp_path):
    report = _judge(tmp_path, defects=[Defect("deadlock", 2, 4)])
    (verdict,) = report.verdicts
    assert (verdict.kind, verdict.replica, verdict.step, verdict.ranks) == ("hang", 2, 4, (4, 5))
    assert "replica 2 (it skipped ahead to dp all_reduce DRAFT_PREFILL" in verdict.detail
    assert "replica 2 (it skipped expert forward TARGET" in verdict.detail


@pytest.mark.parametrize("replica", [0, 2])
def test_an_extra_draft_pass_is_named_from_k_in_the_job_record(tmp_path, replica):
    """K = 1, and the culprit entered a DRAFT_DECODE agreement after its draft while its peers
    finished the step and wait in the next one's agreement: from the logs alone its peers look
    like the ones that did not issue it. With K in the job record (`agree.order`, rule 0) the
    culprit is named, and only it (at step 5, and as the one its peers wait for at step 6).
    Mutation: `Groups.last_phase` returns None -> the hang blames the peers."""
    spec = SynthSpec(dp_size=3, pcp_size=2, steps=10, spec_tokens=1, job_names_k=True)
    report = _judge(tmp_path, spec, [Defect("extra_draft_pass", replica, 5)])
    assert {(v.kind, v.replica, v.step) for v in report.verdicts} == {
        ("collective_mismatch", replica, 5), ("hang", replica, 5), ("hang", replica, 6)}, report.format()
    hang = next(v for v in report.verdicts if v.kind == "hang" and v.step == 5)
    assert "a phase past the last of any step of this job" in hang.detail
    unnamed = _judge(tmp_path / "without-k", dataclasses.replace(spec, job_names_k=False),
                     [Defect("extra_draft_pass", replica, 5)])
    assert any(v.kind == "hang" and v.replica != replica for v in unnamed.verdicts), unnamed.format()


def test_gap_says_which_file_and_line(tmp_path):
    report = _judge(tmp_path, defects=[Defect("gap", 1, 2)])
    files = {(v.file, v.line) for v in report.verdicts}
    assert files == {("rank-2.jsonl", 46), ("rank-3.jsonl", 46)}, report.format()  # line 1: the job's shape
    assert "seq 45 missing: seq jumps from 44 to 46" in report.verdicts[0].detail


def test_fault_of_the_replica_that_failed_comes_before_relayed_ones(tmp_path):
    report = _judge(tmp_path, defects=[Defect("fault", 2, 4)])
    assert [(v.replica, v.error) for v in report.verdicts] == [(2, "BatchError"), (0, "ReplicaFault"),
                                                               (1, "ReplicaFault")]


RUN_ON_DEFECTS = [Defect(kind, replica, step) for kind, replica, step in (
    ("gap", 0, 3), ("missing_replica", 1, 6), ("agreed_mismatch", 2, 8), ("pg_seq", 0, 11),
    ("collective_mismatch", 1, 13), ("skip_dummy_forward", 2, 16), ("illegal_transition", 0, 18),
    ("stale_buffer_replay", 1, 21), ("moved_buffer", 2, 24))]


@pytest.mark.parametrize("defects", [
    RUN_ON_DEFECTS,
    RUN_ON_DEFECTS[:4] + [Defect("hang", 1, 26)],
    RUN_ON_DEFECTS[:4] + [Defect("deadlock", 0, 14)],
    RUN_ON_DEFECTS[:4] + [Defect("truncated", 2, 20)],
    RUN_ON_DEFECTS[:4] + [Defect("fault", 0, 23)],
], ids=["runs-on", "hang", "deadlock", "truncated", "fault"])
def test_ranges_of_steps_judged_side_by_side_give_the_same_report(tmp_path, defects):
    # 3 and 4 processes cut this 30-step run at different steps, between and around defects
    run = write_run(tmp_path / "run", SynthSpec(dp_size=3, pcp_size=2, steps=30, spec_tokens=2), defects)
    single = replay(run, jobs=1)
    assert {(v.replica, v.step) for v in single.verdicts} >= {(d.replica, d.step) for d in defects[:4]}
    for jobs in (3, 4):
        assert replay(run, jobs=jobs) == single


def test_seek_step_finds_the_first_line_of_a_step_by_bisection(tmp_path):
    import json as _json

    from runner_fsm.audit.seek import SeekOrigin, last_step_of, seek_step

    run = write_run(tmp_path / "run", SynthSpec(dp_size=2, pcp_size=1, steps=400))
    path = run / "rank-1.jsonl"
    data = path.read_bytes()
    starts, steps, offset = [], [], 0
    for line in data.splitlines(keepends=True):
        starts.append(offset)
        steps.append(_json.loads(line)["step_id"])
        offset += len(line)
    assert len(data) > 4 * (1 << 16)  # large enough for the bisection to take several rounds
    for target in (-3, -1, 0, 1, 137, 398, 399, 400):
        line = next((i for i, step in enumerate(steps) if step is not None and step >= target), len(starts))
        want = starts[line] if line < len(starts) else len(data)
        assert seek_step(path, target) == want, target
        origin = SeekOrigin(path, want, compact=False, line_known=False)
        assert origin.line_shift() == line  # the line numbers a range reports, counted when asked
    assert last_step_of(path) == 399
