"""Judge a run in ranges of steps, one process per range, all streaming.

Each rank's file is ordered by step, so the byte offset where any step starts is found by
bisection, and a process can judge steps [lo, hi) of every rank alone: it starts a few steps
early (`WARMUP_STEPS`: the previous buffers snapshot, the transition state, the collective
template) and keeps only the findings from `lo` on. No step crosses a pipe, so the processes
never wait on each other; each one's memory is that of a single-process replay.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import orjson

from runner_fsm.audit.crossrank import CrossRankChecker, MissedSteps
from runner_fsm.audit.facts import RankEnd, RunFacts
from runner_fsm.audit.mapped import data_end, is_blank
from runner_fsm.audit.ranks import Groups, RankInfo
from runner_fsm.audit.read import RankStep, StepMerger
from runner_fsm.audit.report import ReplayInputError, Verdict
from runner_fsm.audit.scan import RankScanner

WARMUP_STEPS = 8
_TAIL = 1 << 16


@dataclasses.dataclass
class RangeResult:
    """What judging one range of steps found."""

    verdicts: list[Verdict]
    missed: list[MissedSteps]
    records: int
    first_step: int | None
    last_step: int | None
    facts: RunFacts  # stop requests, faults, injections and where each log ends (`facts`)


def scan_rank(info: RankInfo, verdicts: list[Verdict], counter: dict[int, int], cut: set[int] | None = None,
              *, offset: int = 0, count_from: int | None = None, stop_step: int | None = None,
              facts: RunFacts | None = None) -> Iterator[RankStep]:
    """The steps of one rank's log, in order; `counter[rank]` ends as its record count.

    A range of steps (see `ranges`): from byte `offset` (a line start past the head) up to
    `stop_step`; a rank stopped there goes into `cut` (its log goes on, in another range).
    The captures at the head of the file are read first, since every replay is checked
    against them. Line numbers in verdicts count from `offset`; `counter` counts the records
    of steps from `count_from` on (earlier ones, read to warm up, are another range's)."""
    scanner = RankScanner(info, verdicts, facts)
    scanner.count_from = count_from
    try:
        with open(info.path, "rb") as lines:
            if offset > 0:
                for _ in scanner.scan(lines, stop_step=0):  # the head: captures at step -1
                    pass
                scanner.resume_mid_file()
                lines.seek(offset)
            scanner.stopped = False
            yield from scanner.scan(lines, stop_step=stop_step)
    except OSError as err:
        raise ReplayInputError(f"cannot read {info.path}: {err}") from err
    if scanner.stopped:
        if cut is not None:
            cut.add(info.global_rank)
        counter[info.global_rank] = scanner.records_counted
        return
    last = scanner.finish()
    counter[info.global_rank] = scanner.records_counted
    if last is not None:
        if facts is not None:  # where the log ends: its last record's time, its state then
            end = _last_record(info.path)
            t_ns = end.get("t_ns") if end is not None else None
            facts.ends[info.global_rank] = RankEnd(info.global_rank, info.dp_rank, last.step,
                                                   t_ns if isinstance(t_ns, int) else None,
                                                   scanner.transitions.state, last.hang is not None)
        yield last


def judge_range(infos: list[RankInfo], lo: int | None = None, hi: int | None = None, *,
                timeline=None) -> RangeResult:
    """Judge steps [lo, hi) of every rank (None: from the start, to the end)."""
    verdicts: list[Verdict] = []
    facts = RunFacts()
    counts: dict[int, int] = {}
    cut: set[int] = set()
    streams, ended_before, offsets = {}, {}, {}
    infos_by_rank = {info.global_rank: info for info in infos}
    for info in infos:
        offset = 0 if lo is None else seek_step(info.path, lo - WARMUP_STEPS)
        if lo is not None and offset >= data_end(info.path):
            ended_before[info.global_rank] = last_step_of(info.path)  # nothing left in this range
            continue
        offsets[info.global_rank] = offset
        streams[info.global_rank] = scan_rank(info, verdicts, counts, cut, offset=offset, count_from=lo,
                                              stop_step=hi, facts=facts)
    merger = StepMerger(streams, ended_before=ended_before, cut=cut)  # reads every job record first
    checker = CrossRankChecker(Groups(infos), merger, verdicts)
    first = last = None
    injected = facts.injected_steps()
    for step, present in merger:
        checker.check(step, present)
        if timeline is not None:
            timeline.add(step, present)
        if lo is None or step >= lo:
            first = step if first is None else first
            last = step
        if step in injected:  # what each replica ran where an injection should act
            for summary in present.values():
                facts.kinds.setdefault((infos_by_rank[summary.rank].dp_rank, step), summary.kind)
    missed = checker.finish()
    if lo is not None:
        verdicts = _own_verdicts(verdicts, lo, infos, offsets)
        missed = _own_missed(missed, lo)
    return RangeResult(verdicts, missed, sum(counts.values()), first, last, facts.own_range(lo))


def _own_verdicts(verdicts: list[Verdict], lo: int, infos, offsets) -> list[Verdict]:
    """The findings of steps from `lo` on (earlier ones are the previous range's), with line
    numbers counted from the start of the file again."""
    kept = [v for v in verdicts if v.step is not None and v.step >= lo]
    by_file = {info.file: info for info in infos}
    bases: dict[str, int] = {}
    fixed = []
    for verdict in kept:
        info = by_file.get(verdict.file)
        if info is not None and verdict.line and offsets.get(info.global_rank):
            if verdict.file not in bases:
                bases[verdict.file] = newlines_before(info.path, offsets[info.global_rank])
            verdict = dataclasses.replace(verdict, line=verdict.line + bases[verdict.file])
        fixed.append(verdict)
    return fixed


def _own_missed(missed: list[MissedSteps], lo: int) -> list[MissedSteps]:
    own = []
    for run in missed:
        if run.last < lo:
            continue
        if run.first < lo:
            run = dataclasses.replace(run, first=lo, continued=True)
        own.append(run)
    return own


# ---------------------------------------------------------------- finding steps in files


def _step_of(raw: bytes):
    try:
        step = orjson.loads(raw)["step_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _first_step_from(handle, position: int) -> tuple[int, int | None]:
    """(start of the first whole line at or after `position` that has a step, that step);
    (end of file, None) when there is none."""
    handle.seek(position)
    if position:
        handle.readline()  # the rest of a line that started earlier
    while True:
        start = handle.tell()
        raw = handle.readline()
        if not raw or is_blank(raw):  # the end, or the blank tail of an unclosed log
            return start, None
        step = _step_of(raw)
        if step is not None:
            return start, step


def seek_step(path: Path, step: int) -> int:
    """Byte offset of the first line of `path` whose step is `step` or later (the end of its
    data when there is none), by bisection: the file is ordered by step."""
    with open(path, "rb") as handle:
        low, high = 0, data_end(path)
        while high - low > _TAIL:
            middle = (low + high) // 2
            start, found = _first_step_from(handle, middle)
            if found is None or found >= step:
                if start >= high:
                    break
                high = start
            else:
                low = middle
        handle.seek(low)
        if low:
            handle.readline()  # the rest of a line that started before `low`
        while True:
            start = handle.tell()
            raw = handle.readline()
            found = _step_of(raw) if raw else None
            if not raw or is_blank(raw) or (found is not None and found >= step):
                return start


def last_step_of(path: Path) -> int | None:
    """The step of the last readable record of `path` that has one (None when none has)."""
    found = _last_record(path, lambda record: isinstance(record.get("step_id"), int))
    return None if found is None else found["step_id"]


def _last_record(path: Path, accept=lambda record: True) -> dict | None:
    """The last readable record of `path` that `accept` takes (None when there is none)."""
    size = data_end(path)  # without the blank tail of a log that was not closed
    with open(path, "rb") as handle:
        span = _TAIL
        while True:
            handle.seek(max(0, size - span))
            lines = handle.read(size - max(0, size - span)).splitlines()
            for raw in reversed(lines[1:] if size > span else lines):
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(record, dict) and accept(record):
                    return record
            if span >= size:
                return None
            span *= 4


def newlines_before(path: Path, offset: int) -> int:
    count = 0
    with open(path, "rb") as handle:
        while offset > 0:
            chunk = handle.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def split_steps(infos: list[RankInfo], parts: int) -> list[int]:
    """Step ids that cut the largest file into `parts` about equal byte ranges."""
    ends = {info.global_rank: data_end(info.path) for info in infos}
    biggest = max(infos, key=lambda info: ends[info.global_rank])
    size = ends[biggest.global_rank]
    bounds: list[int] = []
    with open(biggest.path, "rb") as handle:
        for part in range(1, parts):
            _, step = _first_step_from(handle, size * part // parts)
            if step is not None and step > max(bounds, default=0):
                bounds.append(step)
    return bounds


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


def judge_in_ranges(infos: list[RankInfo], jobs: int) -> RangeResult:
    """`judge_range` over `jobs` ranges of steps: the first in this process, the others in
    child processes started at once, so that all run side by side."""
    bounds = split_steps(infos, jobs)
    ranges = list(zip([None, *bounds], [*bounds, None]))
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
        results = [judge_range(infos, *ranges[0])]
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
    return RangeResult([v for r in results for v in r.verdicts], [m for r in results for m in r.missed],
                       sum(r.records for r in results), min(firsts, default=None), max(lasts, default=None),
                       RunFacts.merge([r.facts for r in results]))


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
