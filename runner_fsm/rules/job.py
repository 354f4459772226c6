"""Every rank the job's shape names must have left a log (`missing_rank`).

The shape is read from the first record of each log (`audit.shape`); all logs of one run
declare the same one, each for the rank its file name says. What contradicts that is not a
finding about the run but input that cannot be judged (logs of several runs in one
directory, a file renamed): `ReplayInputError`, exit status 2.

Logs written before the shape was logged (runner_fsm before issue 16, or a worker that does
not write it yet) are judged as before, from the files found, and the report says so in a
note: a missing log cannot be seen there (the Flight Recorder dumps, when the run left them,
still name members without a log: `replay.flight_join`).
"""

from __future__ import annotations

import dataclasses

from runner_fsm.audit.mapped import data_end
from runner_fsm.audit.shape import JobShape
from runner_fsm.errors import ReplayInputError
from runner_fsm.rules.ranks import RankInfo
from runner_fsm.rules.verdicts import Verdict

NO_SHAPE_NOTE = ("no log begins with the job's shape (logs of an older writer): the ranks are taken"
                 " from the files found, so the logs alone cannot show a rank whose log is missing")


@dataclasses.dataclass(frozen=True)
class JobCheck:
    """The shape the logs declare (None: none does), the verdicts it implies and notes."""

    shape: JobShape | None
    verdicts: tuple[Verdict, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def expected_ranks(self) -> int | None:
        return None if self.shape is None else self.shape.world_size


def check_job(infos: list[RankInfo], world_size: int | None = None) -> JobCheck:
    """The job's shape from `infos` and a `missing_rank` verdict per rank it names with no log.

    `world_size` (the user's `--world-size`): where the logs declare the shape, it must agree
    (else `ReplayInputError`); where they do not (an older writer), it names the ranks instead."""
    if world_size is not None and world_size < 1:
        raise ReplayInputError(f"--world-size must be a positive number of ranks, got {world_size}")
    declared = [info for info in infos if info.shape is not None]
    if not declared:
        return JobCheck(None, notes=(NO_SHAPE_NOTE,)) if world_size is None else _given_world(infos, world_size)
    first = declared[0]
    shape = first.shape
    if world_size is not None and world_size != shape.world_size:
        raise ReplayInputError(f"--world-size {world_size} contradicts the job's shape, {shape.text()} (the first"
                               f" record of {first.file})")
    for info in declared[1:]:
        if info.shape != shape:
            raise ReplayInputError(
                f"{info.path} declares the job {info.shape.text()}, {first.path} declares {shape.text()}:"
                f" logs of different runs given as one (one directory, or the directories of one job)")
    for info in infos:
        _check_place(info, shape, first.file)
    present = {info.global_rank for info in infos}
    hosts = hosts_of(infos)
    verdicts = tuple(_missing(rank, shape, first.file, hosts.get(rank)) for rank in range(shape.world_size)
                     if rank not in present)
    undeclared = [info.file for info in infos if info.shape is None and data_end(info.path)]
    notes = ()
    if undeclared:
        notes = (f"{', '.join(undeclared)} do(es) not begin with the job's shape that {first.file} begins"
                 f" with (its first record is lost, or another writer wrote it)",)
    return JobCheck(shape, verdicts, notes)


def _check_place(info: RankInfo, shape: JobShape, source: str) -> None:
    """A log must be one of the job's ranks, at the coordinates the shape gives that rank."""
    if info.global_rank >= shape.world_size:
        raise ReplayInputError(f"{info.file} is not a rank of the job {shape.text()} ({source}'s first record):"
                               f" global ranks run 0..{shape.world_size - 1}")
    expected = shape.coords(info.global_rank)
    if info.coords != expected:
        raise ReplayInputError(
            f"{info.file}: its records say {info.coords.text(shape.sizes)}; the job {shape.text()} puts global"
            f" rank {info.global_rank} at {expected.text(shape.sizes)}")


def hosts_of(infos: list[RankInfo]) -> dict[int, str]:
    """{global rank: host} as the `job` records say: each log's own host, and the job's hosts
    where a worker gathered them at start-up (`hosts`: {host: [ranks]})."""
    out: dict[int, str] = {}
    for info in infos:
        for host, ranks in (info.hosts or {}).items():
            out.update((int(rank), str(host)) for rank in ranks)
    out.update((info.global_rank, info.host) for info in infos if info.host)
    return out


def _missing(rank: int, shape: JobShape, source: str, host: str | None) -> Verdict:
    where = f" on host {host}" if host else ""
    return Verdict("missing_rank", shape.coords(rank).dp, None,
                   f"{shape.rank_text(rank)}{where} left no audit log: the job's shape ({shape.text()}, in the"
                   f" first record of {source}) names it, and rank-{rank}.jsonl is missing; nothing it did can be"
                   " judged", (rank,), f"rank-{rank}.jsonl")


def _given_world(infos: list[RankInfo], world_size: int) -> JobCheck:
    """Logs of a writer that logs no shape, judged against the user's `--world-size`."""
    outside = sorted(info.global_rank for info in infos if info.global_rank >= world_size)
    if outside:
        raise ReplayInputError(f"rank-{outside[0]}.jsonl lies outside --world-size {world_size}"
                               f" (global ranks run 0..{world_size - 1})")
    pcp_size = 1 + max(info.pcp_rank for info in infos)
    present = {info.global_rank for info in infos}
    verdicts = []
    for rank in range(world_size):
        if rank not in present:
            replica, pcp_rank = divmod(rank, pcp_size)
            verdicts.append(Verdict("missing_rank", replica, None,
                                    f"rank {rank} (replica {replica}, PCP rank {pcp_rank}) left no audit log: the"
                                    f" job's world size is {world_size} (--world-size), and rank-{rank}.jsonl is"
                                    " missing; nothing it did can be judged", (rank,), f"rank-{rank}.jsonl"))
    note = (f"no log begins with the job's shape (logs of an older writer): the ranks are taken from"
            f" --world-size {world_size}")
    return JobCheck(None, tuple(verdicts), (note,))
