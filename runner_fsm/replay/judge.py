"""`runner-fsm replay RUN_DIR`: judge a run from its audit logs alone (DESIGN section 7).

In the order a replay uses them (docs/architecture.md, "Where a verdict is decided"):
- `discover`: the run found once (`Run`): each rank's files, coordinates, groups and host;
- `rules.job`: the job's shape against the logs found (`missing_rank`);
- `scan` (through `rankscan`): one pass over each rank's log, the rules that need no peer;
- `rules.rank_steps`: each rank's steps merged by step id;
- `rules.crossrank`, `sequences`, `pairing`, `consensus`: the rules across the ranks of a step
  (`pairing` names a DP desync's culprit by `agree.order`, the rule `dp.agree` applies online);
- `rules.stops`, `rules.injections`: the rules over the whole job, once every log is read;
- `report`: the verdicts' text and JSON, the timeline picture;
- `ranges`: large runs judged in ranges of steps side by side, one process each.
Only one step per rank is held at a time, so memory stays flat however long the run.

Verdict kinds: `missing_rank` (a rank the job's shape names left no log: `job`), the contract's
`gap`, `missing_replica`, `agreed_mismatch`, `collective_mismatch`,
`illegal_transition`, `stale_buffer_replay`, `hang`, and, recomputed from logged evidence,
`dispatch_mismatch`, `stale_context`, `pcp_divergence`, and from the ranks' decision digests
`replica_divergence` and `graph_mode_demoted` (`consensus`); then `fault` (what the runner said about
itself: listed, never the evidence of another verdict), `injection_not_fired` (an injection the
job record names left no `injected` record: the run tested nothing) and `unfinished` (a log
that stops with no shutdown, fault or hang to say why). A stop the job recorded as requested
explains the ends it caused: a note instead (`stops`).

API: `replay(run_dir, *, timeline=None, jobs=None) -> ReplayReport`, `run_dir` one directory or
several (a job on several machines: `rundirs`); `report.exit_code` is 0 when
the run is sound and 1 otherwise; unreadable input raises `ReplayInputError` (exit code 2).
"""

from __future__ import annotations

import dataclasses
import os

from runner_fsm.audit.shape import DIMENSIONS
from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.coverage import resolve_window, rotated_spans
from runner_fsm.replay.discover import Run
from runner_fsm.replay.flight import flight_only, replay_flight_only
from runner_fsm.replay.flight_join import join_flight_recorder
from runner_fsm.replay.ranges import cpu_count, first_kept_step, judge_in_ranges, judge_range
from runner_fsm.replay.rankscan import log_last_step
from runner_fsm.replay.report import ReplayReport, RunSummary, Timeline
from runner_fsm.replay.rundirs import RunDirs, label, read_origins
from runner_fsm.rules.crossrank import join_missed
from runner_fsm.rules.injections import check_injections
from runner_fsm.rules.job import check_job, hosts_of
from runner_fsm.rules.ranks import RankInfo, layout_of
from runner_fsm.rules.stops import settle_stops
from runner_fsm.rules.verdicts import Verdict, sort_verdicts

__all__ = ["ReplayInputError", "ReplayReport", "Verdict", "replay", "replay_with_plot"]

PARALLEL_MIN_BYTES = 64 << 20  # below this, one process is done before others would start
MAX_JOBS = 8


def replay(run_dir: RunDirs | Run, *, timeline: Timeline | None = None,
           jobs: int | None = None, world_size: int | None = None, steps: tuple[int, int] | None = None,
           last: int | None = None, progress=None) -> ReplayReport:
    """Judge the run in `run_dir` (its directories, or the `Run` found in them already); feed
    `timeline` (if given) with every merged step.

    `jobs`: processes, each judging a range of steps (None: one for small runs, else one per
    CPU up to MAX_JOBS). A timeline needs every step in one process, so it implies one.
    `world_size`: the job's (`--world-size`): for Flight Recorder dumps alone, which may not
    name every rank; with audit logs, checked against the shape they declare, or, in logs of
    a writer that declares none, taken as the ranks to expect. `steps` (A, B), both included,
    or `last` N: judge that window alone (`coverage`). `progress`: a
    `progress.TerminalProgress`, told the steps to judge and, now and then, the step reached.
    """
    if isinstance(run_dir, Run):
        run = run_dir
    elif flight_only(run_dir):  # a plain PyTorch job: Flight Recorder dumps and no audit log
        return replay_flight_only(run_dir, world_size)
    else:
        run = Run.find(run_dir)
    infos = list(run.ranks)
    job = check_job(infos, world_size)  # before the long pass: logs of different runs are refused at once
    log_steps = (min(map(first_kept_step, infos)), max((log_last_step(i) or 0 for i in infos), default=0))
    try:
        window = resolve_window(log_steps[1], steps=steps, last=last)
    except ValueError as err:
        raise ReplayInputError(str(err)) from None
    lo, hi = (window[0], window[1] + 1) if window is not None else (None, None)
    jobs = auto_jobs(infos) if jobs is None else max(1, jobs)
    if progress is not None:
        progress.span(lo if lo is not None else log_steps[0], hi - 1 if hi is not None else log_steps[1], jobs)
    if jobs > 1 and timeline is None:
        result = judge_in_ranges(infos, jobs, lo, hi, progress=progress)
    else:
        result = judge_range(infos, lo, hi, timeline=timeline, progress=progress)
    verdicts = list(job.verdicts) + result.verdicts + join_missed(result.missed) + check_injections(result.facts)
    result.facts.origins, unread = read_origins(run.dirs, {info.run_id for info in infos})
    verdicts, stop_note = settle_stops(verdicts, result.facts)
    sizes = layout_of(infos)
    notes = job.notes + stop_note + tuple(result.facts.storage) + tuple(unread)
    summary = RunSummary(run.label, len(infos), sizes.dp, sizes.pcp, result.records,
                         result.first_step, result.last_step, job.expected_ranks, notes,
                         sizes.tp, sizes.pp, window, log_steps,
                         rotated_spans((rank, tuple(spans)) for rank, spans in result.rotated.items()))
    verdicts = drop_explained(join_mismatches(merge_same_findings(verdicts)))
    report = ReplayReport(summary, sort_verdicts(name_coordinates(verdicts, infos, job)))
    return join_flight_recorder(report, run)  # Flight Recorder dumps, when the run left them


def auto_jobs(infos: list[RankInfo]) -> int:
    """Processes worth starting: one for small runs, where starting more costs more."""
    total = sum(_size(segment.path) for info in infos for segment in info.segments)
    if total < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(cpu_count(), MAX_JOBS))


def _size(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # rotated away by a live writer since it was found
        return 0


def replay_with_plot(run_dir: RunDirs | Run, plot_path: str | os.PathLike[str],
                     *, jobs: int | None = None, world_size: int | None = None, **window) -> ReplayReport:
    """`replay`, then the timeline picture at `plot_path` (matplotlib is checked first)."""
    from runner_fsm.replay.report import plot, require_matplotlib

    require_matplotlib()  # fail before the long pass, not after it
    if not isinstance(run_dir, Run) and flight_only(run_dir):
        raise ReplayInputError(f"--plot draws the steps of audit logs; {label(run_dir)} holds Flight Recorder dumps only"
                               " (replay it without --plot)")
    run = run_dir if isinstance(run_dir, Run) else Run.find(run_dir)
    timeline = Timeline(info.global_rank for info in run.ranks)
    report = replay(run, timeline=timeline, jobs=jobs, world_size=world_size, **window)
    verdict = "sound" if report.sound else f"{len(report.verdicts)} finding(s)"
    plot(timeline, report.verdicts, plot_path, f"{run.label}: {verdict}")
    return report


def name_coordinates(verdicts: list[Verdict], infos: list[RankInfo], job) -> list[Verdict]:
    """Each verdict's ranks with their coordinates (and host, where the logs name it); the text
    names the dimensions beyond the replica that the job uses (PCP, TP, PP)."""
    if job.shape is None:
        return verdicts
    shape, hosts = job.shape, hosts_of(infos)
    shown = tuple(name for name, size in zip(DIMENSIONS, shape.sizes) if name != "dp" and size > 1)
    named = []
    for verdict in verdicts:
        coords = []
        for rank in verdict.ranks:
            if 0 <= rank < shape.world_size:
                entry = {"rank": rank, **shape.coords(rank)._asdict()}
                if rank in hosts:
                    entry["host"] = hosts[rank]
                coords.append(entry)
        named.append(dataclasses.replace(verdict, coords=tuple(coords), shown=shown) if coords else verdict)
    return named


def drop_explained(verdicts: list[Verdict]) -> list[Verdict]:
    """Drop `unfinished` for ranks a `hang` already names as never arriving: one finding, one verdict."""
    culprits = {rank for v in verdicts if v.kind == "hang" for rank in v.ranks}
    return [v for v in verdicts if not (v.kind == "unfinished" and set(v.ranks) <= culprits)]


def join_mismatches(verdicts: list[Verdict]) -> list[Verdict]:
    """One `collective_mismatch` per replica and step: what its collective sequence shows
    (`sequences`) and what its DP agreement met (`pairing`) are one finding, told together."""
    joined: dict[tuple, Verdict] = {}
    out: list[Verdict] = []
    for verdict in verdicts:
        if verdict.kind != "collective_mismatch" or verdict.replica is None:
            out.append(verdict)
            continue
        key = (verdict.replica, verdict.step)
        seen = joined.get(key)
        if seen is None:
            joined[key] = verdict
            out.append(verdict)
            continue
        both = Verdict(seen.kind, seen.replica, seen.step, f"{seen.detail}; and {verdict.detail}",
                       tuple(sorted(set(seen.ranks) | set(verdict.ranks))),
                       seen.file if seen.file == verdict.file else None,
                       seen.line if seen.file == verdict.file else None, seen.error,
                       tuple(dict.fromkeys(seen.evidence + verdict.evidence)))
        out[out.index(seen)] = joined[key] = both
    return out


def merge_same_findings(verdicts: list[Verdict]) -> list[Verdict]:
    """One verdict per finding: the same finding seen from several ranks (the PCP ranks of one
    replica, the DP groups of each PCP rank) becomes one verdict listing every rank."""
    merged: dict[tuple, Verdict] = {}
    for verdict in verdicts:
        # A gap is about one file's lines: never merged with another file's.
        where = (verdict.file, verdict.line) if verdict.kind == "gap" else None
        key = (verdict.kind, verdict.replica, verdict.step, verdict.detail, verdict.error, where)
        seen = merged.get(key)
        if seen is None:
            merged[key] = verdict
        else:
            ranks = tuple(sorted(set(seen.ranks) | set(verdict.ranks)))
            same_file = seen.file == verdict.file
            merged[key] = Verdict(seen.kind, seen.replica, seen.step, seen.detail, ranks,
                                  seen.file if same_file else None, seen.line if same_file else None,
                                  seen.error)
    return list(merged.values())
