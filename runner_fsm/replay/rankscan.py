"""One rank's log read step by step, across its segments (`ranklog`), from any step on.

`scan_rank` yields the rank's `RankStep`s in order. Reading from the start of the log, it goes
through every kept segment; a segment that follows the one before it (numbers consecutive) goes
on where that one ended (seq, transitions, buffers, collectives: one log cut in files); after
a rotation gap the scanner resumes as after a seek, trusting the next record, and marks that
step `resumed` (the steps between were rotated away: nothing is judged of them). From a step
`start` on (a range of steps, `replay --last/--steps`), it reads the head of the log first
(start-up records: every graph replay is judged against its capture), then seeks (`seek`).
"""

from __future__ import annotations

from collections.abc import Iterator

from runner_fsm.audit.compress import open_lines
from runner_fsm.audit.expand import Expander
from runner_fsm.audit.ranklog import SegmentFile, last_step
from runner_fsm.audit.seek import SeekOrigin, locate
from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.scan import RankScanner
from runner_fsm.rules.facts import RankEnd, RunFacts
from runner_fsm.rules.rank_steps import RankStep
from runner_fsm.rules.ranks import RankInfo
from runner_fsm.rules.verdicts import Verdict


def log_last_step(info: RankInfo) -> int | None:
    """The last step of the rank's log (of its newest kept segment with a step)."""
    for segment in reversed(info.segments):
        found = last_step(segment)
        if found is not None:
            return found
    return None


def _start_segment(segments: tuple[SegmentFile, ...], start: int) -> int:
    """The position in `segments` of the one `start` begins in (or after)."""
    position = 0
    for i, segment in enumerate(segments):
        if segment.first_step is not None and segment.first_step <= start:
            position = i
    return position


def scan_rank(info: RankInfo, verdicts: list[Verdict], counter: dict[int, int], cut: set[int] | None = None,
              *, start: int | None = None, count_from: int | None = None, stop_step: int | None = None,
              vanished: list[tuple[int, int]] | None = None, facts: RunFacts | None = None) -> Iterator[RankStep]:
    """The steps of one rank's log, in order; `counter[rank]` ends as its record count.

    From step `start` (None: the start of the log) up to `stop_step`; a rank stopped there goes
    into `cut` (its log goes on, in another range). `counter` counts the records of steps from
    `count_from` on (earlier ones, read to warm up, are another range's). A segment deleted
    since it was found (a live writer rotating it away) is skipped, its steps appended to
    `vanished` (rotated away too). `facts`: where the stops, faults, injections and the log's
    end go (`facts`)."""
    scanner = RankScanner(info, verdicts, facts)
    scanner.count_from = count_from
    segments = info.segments
    try:
        position = 0 if start is None else _start_segment(segments, start)
        offset, line = (0, 1) if start is None else locate(segments[position].path, start,
                                                          compact=segments[position].compact)
        if offset > 0 or position > 0:
            _read_head(scanner, segments[0])
        previous = None
        for i, segment in enumerate(segments[position:], position):
            try:
                if offset == 0 and previous is None and segment is segments[0]:
                    yield from _segment(scanner, segment, stop_step)  # the log from its first line
                else:
                    gap = previous is None or previous is not segments[i - 1] or not segment.follows
                    yield from _segment(scanner, segment, stop_step, offset=offset, line=line, resume=gap)
            except FileNotFoundError:
                if i + 1 == len(segments) or vanished is None:
                    raise
                _note_vanished(vanished, segment, segments[i + 1])
                offset, line = 0, 1
                continue  # `previous` stays: the next segment follows a gap
            if scanner.stopped:
                break
            previous, offset, line = segment, 0, 1
    except OSError as err:
        raise ReplayInputError(f"cannot read {info.path}: {err}") from err
    counter[info.global_rank] = scanner.records_counted
    if scanner.stopped:
        if cut is not None:
            cut.add(info.global_rank)
        return
    last = scanner.finish()
    counter[info.global_rank] = scanner.records_counted
    if last is not None:
        if facts is not None:  # where the log ends: its last record's time, its state then
            t_ns = (scanner.last_record or {}).get("t_ns")
            facts.ends[info.global_rank] = RankEnd(info.global_rank, info.dp_rank, last.step,
                                                   t_ns if isinstance(t_ns, int) else None,
                                                   scanner.transitions.state, last.hang is not None,
                                                   scanner.origin)
        yield last


def _note_vanished(vanished: list, segment: SegmentFile, following: SegmentFile) -> None:
    first = segment.first_step if segment.first_step is not None else 0
    if following.first_step is not None and first <= following.first_step - 1:
        vanished.append((first, following.first_step - 1))


def _read_head(scanner: RankScanner, segment: SegmentFile) -> None:
    """The records before step 0 (start-up, graph captures); then ready to resume elsewhere."""
    with open_lines(segment.path) as lines:
        scanner.file = segment.file
        for _ in scanner.scan(lines, stop_step=0, expand=_expander(segment)):
            pass
    scanner.resume_mid_file()
    scanner.stopped = False


def _segment(scanner: RankScanner, segment: SegmentFile, stop_step: int | None, *, offset: int = 0,
             line: int | None = 1, resume: bool = False) -> Iterator[RankStep]:
    """The steps of one segment from byte `offset` (its line `line`, None: not known, see
    `seek.SeekOrigin`); `resume`: what came before is not this log's previous records (a seek,
    a rotation gap)."""
    with open_lines(segment.path, offset) as lines:
        scanner.file = segment.file
        # read from a seek: what lies before it (lines, the time base) is counted when a verdict asks
        scanner.origin = SeekOrigin(segment.path, offset, compact=segment.compact, line_known=line is not None) \
            if offset > 0 else None
        if offset == 0 and line == 1 and not resume:
            yield from scanner.scan(lines, stop_step=stop_step, expand=_expander(segment))
            return
        expand = Expander(segment.job) if segment.compact else None
        if resume:
            scanner.resume_mid_file()
            if expand is not None:
                expand.resume()
        if offset == 0:
            lines.readline()  # the segment's `job` record: one of the log's records, not a step's
            scanner.continue_with(segment.job, resumed=resume)
            line = 2
        yield from scanner.scan(lines, stop_step=stop_step, expand=expand, first_line=1 if line is None else line)


def _expander(segment: SegmentFile) -> Expander | None:
    return Expander(segment.job) if segment.compact else None
