"""Judge a run in ranges of steps, one process per range, all streaming.

Each rank's log is ordered by step, so where any step starts is found without reading from
the start (`seek`), and a process can judge steps [lo, hi) of every rank alone (`rankscan`): it starts a few steps
early (`WARMUP_STEPS`: the previous buffers snapshot, the transition state, the collective
template) and keeps only the findings from `lo` on. No step crosses a pipe, so the processes
never wait on each other; each one's memory is that of a single-process replay.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback

from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.rankscan import log_last_step, scan_rank
from runner_fsm.rules.crossrank import CrossRankChecker, MissedSteps
from runner_fsm.rules.facts import RunFacts
from runner_fsm.rules.rank_steps import StepMerger
from runner_fsm.rules.ranks import Groups, RankInfo
from runner_fsm.rules.verdicts import Verdict

WARMUP_STEPS = 8


@dataclasses.dataclass
class RangeResult:
    """What judging one range of steps found."""

    verdicts: list[Verdict]
    missed: list[MissedSteps]
    records: int
    first_step: int | None
    last_step: int | None
    facts: RunFacts  # stop requests, faults, injections and where each log ends (`facts`)
    # per rank, the steps its capped log no longer held (found so, or rotated away while read)
    rotated: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)


def judge_range(infos: list[RankInfo], lo: int | None = None, hi: int | None = None, *,
                timeline=None, progress=None) -> RangeResult:
    """Judge steps [lo, hi) of every rank (None: from the start, to the end); `progress(step)`
    now and then."""
    verdicts: list[Verdict] = []
    facts = RunFacts()
    counts: dict[int, int] = {}
    cut: set[int] = set()
    streams, ended_before = {}, {}
    rotated = {info.global_rank: list(info.rotated) for info in infos}  # and what vanishes meanwhile
    for info in infos:
        if lo is not None:
            last = log_last_step(info)
            if last is None or last < lo - WARMUP_STEPS:
                ended_before[info.global_rank] = last  # nothing left in this range
                continue
        streams[info.global_rank] = scan_rank(info, verdicts, counts, cut, count_from=lo, stop_step=hi,
                                              start=None if lo is None else lo - WARMUP_STEPS,
                                              vanished=rotated[info.global_rank], facts=facts)
    merger = StepMerger(streams, ended_before=ended_before, cut=cut, rotated=rotated)
    checker = CrossRankChecker(Groups(infos), merger, verdicts)
    first = last = None
    by_rank = {info.global_rank: info for info in infos}
    injected = facts.injected_steps()
    for step, present in merger:
        checker.check(step, present)
        if timeline is not None:
            timeline.add(step, present)
        if progress is not None and not step & 0xFF:
            progress(step)
        if lo is None or step >= lo:
            first = step if first is None else first
            last = step
        if step in injected:  # what each replica ran where an injection should act
            for summary in present.values():
                facts.kinds.setdefault((by_rank[summary.rank].dp_rank, step), summary.kind)
    missed = checker.finish()
    if lo is not None:
        verdicts = [v for v in verdicts if v.step is not None and v.step >= lo]  # earlier: another range's
        missed = _own_missed(missed, lo)
    return RangeResult(verdicts, missed, sum(counts.values()), first, last, facts.own_range(lo), rotated)


def _own_missed(missed: list[MissedSteps], lo: int) -> list[MissedSteps]:
    own = []
    for run in missed:
        if run.last < lo:
            continue
        if run.first < lo:
            run = dataclasses.replace(run, first=lo, continued=True)
        own.append(run)
    return own


def split_steps(infos: list[RankInfo], parts: int, lo: int | None = None, hi: int | None = None) -> list[int]:
    """Step ids that cut steps [lo, hi) (None: what the logs hold) into `parts` about equal
    ranges (a step's records take about the same bytes all run long)."""
    first = lo if lo is not None else min((first_kept_step(info) for info in infos), default=0)
    last = hi - 1 if hi is not None else max((log_last_step(info) or 0 for info in infos), default=0)
    bounds = [first + (last - first + 1) * part // parts for part in range(1, parts)]
    return sorted({bound for bound in bounds if first < bound <= last})


def first_kept_step(info: RankInfo) -> int:
    """The first step the rank's kept segments hold after rotation (0 for a log that kept its start)."""
    if not info.rotated:
        return 0
    return info.rotated[0][1] + 1 if info.rotated[0][0] <= 0 else 0


# ---------------------------------------------------------------- processes


def _judge_in_child(infos, lo, hi, conn) -> None:
    try:
        conn.send(("ok", judge_range(infos, lo, hi)))
    except ReplayInputError as err:
        conn.send(("input_error", str(err)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("crash", traceback.format_exc()))
    finally:
        conn.close()


def judge_in_ranges(infos: list[RankInfo], jobs: int, lo: int | None = None, hi: int | None = None, *,
                    progress=None) -> RangeResult:
    """`judge_range` of steps [lo, hi) in `jobs` ranges of steps: the first in this process,
    the others in child processes started at once, so that all run side by side."""
    bounds = split_steps(infos, jobs, lo, hi)
    ranges = list(zip([lo, *bounds], [*bounds, hi]))
    methods = multiprocessing.get_all_start_methods()
    # fork starts at once and imports nothing; children touch only files and Python objects.
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    children = []
    for lo, hi in ranges[1:]:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_judge_in_child, args=(infos, lo, hi, send), daemon=True,
                                  name=f"replay-steps-{lo}")
        process.start()
        send.close()
        children.append((process, receive))
    try:
        results = [judge_range(infos, *ranges[0], progress=progress)]
        results += [_result_of(process, receive) for process, receive in children]
    finally:
        for process, _ in children:
            if process.is_alive():
                process.terminate()
            process.join()
    return _combined(results)


def _result_of(process, receive) -> RangeResult:
    try:
        status, payload = receive.recv()
    except EOFError:
        raise RuntimeError(f"replay process {process.name} died (exit code {process.exitcode})") from None
    if status == "input_error":
        raise ReplayInputError(payload)
    if status == "crash":
        raise RuntimeError(f"replay process {process.name} failed:\n{payload}")
    return payload


def _combined(results: list[RangeResult]) -> RangeResult:
    firsts = [r.first_step for r in results if r.first_step is not None]
    lasts = [r.last_step for r in results if r.last_step is not None]
    rotated: dict[int, list] = {}
    for r in results:
        for rank, spans in r.rotated.items():
            rotated.setdefault(rank, [])
            rotated[rank] += [span for span in spans if span not in rotated[rank]]
    return RangeResult([v for r in results for v in r.verdicts], [m for r in results for m in r.missed],
                       sum(r.records for r in results), min(firsts, default=None), max(lasts, default=None),
                       RunFacts.merge([r.facts for r in results]), rotated)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
