"""A replica agrees with itself (`audit.decisions`, `rules.consensus`), from synthetic logs.

Each rank logs a decision digest on its step's `finish` (and the decisions that changed); replay
names the first rank, step and decision where a replica's ranks differ (`replica_divergence`),
sampled tokens that differ between PCP peers as `pcp_divergence` (one finding per fact), and an
idle replica that pulled every replica out of graph mode (`graph_mode_demoted`).
"""

from __future__ import annotations

import pytest

from runner_fsm.audit import AuditLog, read_records, strip_times
from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, DecisionLog, StepDecisions
from runner_fsm.replay.judge import replay
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.testing.logs import rewrite_in_full
from runner_fsm.testing.synth import Defect, SynthSpec, write_run

DECODE = StepDecisions(True, 12345, 4, 8, 8, 1, 777)


def _write(log: AuditLog) -> None:
    decisions = DecisionLog()
    for step, tokens in ((3, 1), (4, 2)):
        log.transition(step, "decode", "ready", "decode", "ok")
        log.transition(step, "finish", "decode", "ready", "ok",
                       decisions.entry(StepDecisions(True, 12345, 4, 8, 8, 1, tokens)))


def test_decisions_read_back_in_full_from_a_compact_log(tmp_path):
    """The digest and the changed decisions on `finish` come back as written, compact or not;
    the second step repeats no decision. Mutation: the expander dropping `dc` (or the writer
    listing it in another order than `FIELDS`) -> fails."""
    with AuditLog(tmp_path / "full", "run-c", 0, 0, 0) as full:
        _write(full)
    with AuditLog(tmp_path / "compact", "run-c", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)) as compact:
        _write(compact)
    written = [strip_times(r) for r in read_records(full.path)]
    read = [{**strip_times(r), "seq": r["seq"] - 1} for r in read_records(compact.path)][1:]
    assert read == written
    finishes = [r for r in written if r["trigger"] == "finish"]
    assert finishes[0][DECISIONS_FIELD] == {"real": 1, "batch": 12345, "dispatch": 4, "padded": 8, "graph": 8,
                                            "draft": 1}
    assert DECISIONS_FIELD not in finishes[1]  # unchanged: the digest alone
    assert finishes[1][DIGEST_FIELD] == StepDecisions(True, 12345, 4, 8, 8, 1, 2).digest()
    assert finishes[0][DIGEST_FIELD] != finishes[1][DIGEST_FIELD]  # the sampled tokens are in it


def test_a_digest_costs_few_bytes_a_step(tmp_path):
    """A step whose decisions did not change adds its digest only: at most 16 bytes on disk.
    Mutation: logging every decision every step -> over. The lines are compared without their
    time field (`"t"`: the time since the record before, whose digits follow the machine's load:
    a loaded box once made the digest's line one digit longer there)."""
    import re

    sizes = []
    for with_digest in (False, True):
        with AuditLog(tmp_path / str(with_digest), "run-c", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)) as log:
            decisions = DecisionLog()
            for step in range(100, 110):
                log.transition(step, "decode", "ready", "decode", "ok")
                log.transition(step, "finish", "decode", "ready", "ok",
                               decisions.entry(StepDecisions(True, 5, 1, 1, 0, 0, 4_000_000_000 + step))
                               if with_digest else None)
        sizes.append(len(re.sub(rb'"t":\d+,', b"", log.path.read_bytes().splitlines()[-1])))
    assert 0 < sizes[1] - sizes[0] <= 16, sizes


def _verdicts(run_dir):
    return [(v.kind, v.replica, v.step, v.ranks) for v in replay(run_dir).verdicts]


SPEC = SynthSpec(dp_size=3, pcp_size=3, steps=12, decisions=True, compact=True)


def test_clean_runs_with_digests_replay_sound(tmp_path):
    """Every replica's ranks log the same digests: sound, PCP and TP alike, compact or in full.
    Mutation: the ranks of every replica compared as one replica -> findings."""
    for name, spec in (("pcp", SPEC), ("tp", SynthSpec(dp_size=2, pcp_size=2, tp_size=2, decisions=True)),
                       ("full", SynthSpec(dp_size=2, pcp_size=3, decisions=True))):
        run = write_run(tmp_path / name, spec)
        assert any(DIGEST_FIELD in r for r in read_records(run / "rank-1.jsonl"))
        assert replay(run).sound, replay(run).format()


@pytest.mark.parametrize("replica,rank", [(0, 0), (2, 2)])
def test_a_rank_in_the_other_graph_mode_is_named(tmp_path, replica, rank):
    """The first rank of replica 0, the last rank of the last replica: `replica_divergence`
    naming that rank (a majority of 3 knows which), the step and the decision (`graph`), from
    the logs alone. Mutation: `_first_difference` given the reference's decisions twice -> the
    decision is not named."""
    run = write_run(tmp_path, SPEC, [Defect("rank_graph_mode", replica, 6, rank)])
    report = replay(run)
    culprit = replica * 3 + rank
    assert _verdicts(run) == [("replica_divergence", replica, 6, (culprit,))], report.format()
    assert "decided graph=" in report.verdicts[0].detail


@pytest.mark.parametrize("replica,rank", [(1, 0), (0, 1)])
def test_two_ranks_name_the_one_that_ran_eager_beside_a_replay(tmp_path, replica, rank):
    """PCP=2, no majority: the rank that ran eager the batch its peer replayed as a graph of G
    rows, though it had captured a graph of G rows, is named (its PCP rank 0 in one replica, 1
    in the other). Evidence missing: without the capture records, both ranks are named, "no
    majority", and the verdict claims no capture. Mutations: `_eager_beside_a_replay` ignoring the
    captured sizes -> the stripped case still names one rank; the wording re-derived from the
    decisions instead of carried from the tie-break -> it claims a capture on replica 0."""
    run = write_run(tmp_path / "run", SynthSpec(dp_size=2, pcp_size=2, decisions=True),
                    [Defect("rank_graph_mode", replica, 5, rank)])
    report = replay(run)
    assert _verdicts(run) == [("replica_divergence", replica, 5, (replica * 2 + rank,))], report.format()
    assert "decided graph=0" in report.verdicts[0].detail and "had captured that graph" in report.verdicts[0].detail

    def without_captures(records):
        return [r for r in records if not (r["event"] == "buffers" and r["reason"] == "capture")
                and not (r["event"] == "graph" and r["action"] == "capture")]
    for path in run.glob("rank-*.jsonl"):
        rewrite_in_full(path, without_captures)
    report = replay(run)
    pair = (replica * 2, replica * 2 + 1)
    assert [(v.kind, v.replica, v.step, v.ranks) for v in report.verdicts
            if v.kind == "replica_divergence"] == [("replica_divergence", replica, 5, pair)], report.format()
    detail = [v for v in report.verdicts if v.kind == "replica_divergence"][0].detail
    assert "no majority" in detail and "had captured" not in detail, detail  # no evidence claimed that is gone


def test_sampled_tokens_of_pcp_peers_are_pcp_divergence(tmp_path):
    """One finding per fact: PCP peers that sampled other tokens are `pcp_divergence` (from the
    digests: every logged decision agrees), TP peers that did are `replica_divergence`.
    Mutation: `_pcp_peers` always False -> replica_divergence for the PCP case."""
    pcp = write_run(tmp_path / "pcp", SPEC, [Defect("rank_tokens", 0, 5)])
    assert _verdicts(pcp) == [("pcp_divergence", 0, 5, (0, 1, 2))], replay(pcp).format()
    tp = write_run(tmp_path / "tp", SynthSpec(dp_size=2, pcp_size=1, tp_size=3, decisions=True),
                   [Defect("rank_tokens", 1, 4, 0)])
    report = replay(tp)
    assert _verdicts(tp) == [("replica_divergence", 1, 4, (3,))], report.format()
    assert "sampled other tokens" in report.verdicts[0].detail


def test_ranks_without_digests_are_not_judged(tmp_path):
    """Evidence missing: logs without digests (older writers) replay sound whatever they did, and
    a rank whose digests are gone is left out while its peers are still compared. Mutation:
    letting a rank without digest vote (no `is not None` filter in `check`) -> rank 0 named."""
    old = write_run(tmp_path / "old", SynthSpec(dp_size=3, pcp_size=3, steps=12), [Defect("rank_graph_mode", 0, 7, 0)])
    assert replay(old).sound
    run = write_run(tmp_path / "mixed", SPEC, [Defect("rank_graph_mode", 0, 7, 2)])

    def without_digests(records):
        return [{k: v for k, v in r.items() if k not in (DIGEST_FIELD, DECISIONS_FIELD)} for r in records]

    rewrite_in_full(run / "rank-0.jsonl", without_digests)
    report = replay(run)
    assert _verdicts(run) == [("replica_divergence", 0, 7, (1, 2))], report.format()


@pytest.mark.parametrize("replica", [0, 2])
def test_an_idle_replica_that_demotes_the_graph_mode_is_named(tmp_path, replica):
    """Replica 0 and the last: idle, it proposed eager while the others proposed a graph and it
    had captured one that fits: `graph_mode_demoted` naming it (with or without digests).
    Mutation: requiring the idle replica to have no capture -> no verdict."""
    for decisions in (True, False):
        run = write_run(tmp_path / str(decisions), SynthSpec(dp_size=3, pcp_size=2, steps=10, decisions=decisions),
                        [Defect("graph_demoted", replica, 5)])
        report = replay(run)
        assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("graph_mode_demoted", replica, 5)], \
            report.format()
        assert report.exit_code == 1


def test_rank_faults_name_one_rank_of_the_replica():
    """`KIND@replica=R,step=S,rank=K`: required by the kinds that make one rank disagree,
    refused by the others, checked against the ranks a replica has; replay's injection records
    read the same target. Mutation: `due` ignoring `rank` -> every rank of the replica fires."""
    from runner_fsm.errors import ConfigError
    from runner_fsm.faults import Injection, Injector, parse_target, static_problem

    injection = Injection.parse("tp-skip-draft@replica=1,step=5,rank=2")
    assert (injection.replica, injection.step, injection.rank) == (1, 5, 2)
    assert str(injection) == "tp-skip-draft@replica=1,step=5,rank=2"
    assert parse_target(str(injection)) == (1, 5)
    with pytest.raises(ConfigError, match="add ,rank=K"):
        Injection.parse("rank-graph-mode@replica=0,step=3")
    with pytest.raises(ConfigError, match="takes no rank"):
        Injection.parse("crash@replica=0,step=3,rank=1")
    assert "no rank 2" in static_problem(injection, dp_size=2, pcp_size=2, spec_tokens=1)
    assert static_problem(injection, dp_size=2, pcp_size=3, spec_tokens=1) is None
    injector = Injector([injection])
    assert [injector.due("tp-skip-draft", 1, 5, rank) for rank in range(3)] == [False, False, True]


def test_a_window_names_the_divergence_without_the_decisions_logged_before_it(tmp_path):
    """`--last 20` seeks past the steps that logged the decisions: the digests still name the
    rank and step, and the detail says the decision is not known (not taken for the sampled
    tokens, which between PCP peers would be `pcp_divergence`). Mutation: `first_difference`
    taking unknown decisions for equal ones -> pcp_divergence."""
    run = write_run(tmp_path, SynthSpec(dp_size=3, pcp_size=3, steps=400, decisions=True, compact=True),
                    [Defect("rank_graph_mode", 2, 391, 2)])
    whole, window = replay(run), replay(run, last=20)
    assert [(v.kind, v.replica, v.step, v.ranks) for v in whole.verdicts] == [("replica_divergence", 2, 391, (8,))]
    assert [(v.kind, v.replica, v.step, v.ranks) for v in window.verdicts] == [("replica_divergence", 2, 391, (8,))]
    assert "decided graph=" in whole.verdicts[0].detail
    assert "logged before the steps read" in window.verdicts[0].detail, window.format()


def test_a_capped_log_keeps_its_digests(tmp_path):
    """Written under a byte cap (segments rotated away), the digests are still on every kept
    `finish` and a divergence after the rotation is named. Mutation: the capped writer dropping
    `decided` from the transition -> sound."""
    # 80 kB keeps about the last 26 steps: a compact record's size follows the time between records,
    # so under load a rank rotates a segment (13 steps) sooner; with 40 kB rank 5 once kept only 298..
    spec = SynthSpec(dp_size=2, pcp_size=3, steps=300, decisions=True, compact=True, max_log_bytes=80_000,
                     pinned_steps=5)
    run = write_run(tmp_path, spec, [Defect("rank_graph_mode", 1, 292, 2)])
    report = replay(run)
    assert report.summary.rotated, report.format()
    assert _verdicts(run) == [("replica_divergence", 1, 292, (5,))], report.format()
