"""Reading Flight Recorder dumps (`fr-rank-<global_rank>.json`) and matching ranks by group and seq.

A dump is either the runner's (`runner_fsm.process.flight_recorder`: the torch trace plus the audit
names and members of this rank's groups) or torch's own JSON (`_dump_fr_trace_json`) written
by any PyTorch job. Groups are identified across ranks by their process-group name (the same
on every member, since every rank creates the groups in the same order), and collectives by
their sequence number in that group, never by their position in the ring buffer: PyTorch's
`fr_trace` matches by position, which cannot tell a skipped collective from a late one.

`divergence_verdicts(dumps)` is the Flight-Recorder-only judgement (a plain PyTorch job):
per group, the first sequence number at which the members differ and the ranks behind.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.report import ReplayReport, RunSummary
from runner_fsm.replay.rundirs import RunDirs, as_dirs, label, ranked_files
from runner_fsm.rules.verdicts import Verdict, sort_verdicts

DUMP_FILE = re.compile(r"^fr-rank-(\d+)\.json$")
EVIDENCE = ("flight_recorder",)


@dataclasses.dataclass(frozen=True)
class FlightEntry:
    """One collective in a rank's ring buffer."""

    seq: int  # collective_seq_id: 1 for the group's first collective
    op: str  # profiling_name, e.g. gloo:all_reduce
    sizes: tuple
    retired: bool  # completed (or waited on); False: still in flight when dumped
    t_ns: int  # time_created_ns (wall clock)
    dtypes: tuple = ()

    @property
    def label(self) -> str:
        dtypes = f" {'/'.join(self.dtypes)}" if self.dtypes else ""
        return f"{self.op} {list(map(list, self.sizes))}{dtypes}"

    @property
    def match_key(self) -> tuple:
        """What every member of a group must issue alike at one seq. An all_to_all's sizes are
        each rank's own (uneven splits), so only its op and dtypes count, as in PyTorch's fr_trace."""
        if "all_to_all" in self.op:
            return self.op, self.dtypes
        return self.op, self.sizes, self.dtypes


@dataclasses.dataclass
class RankDump:
    """One rank's dump: per process-group name, what it issued."""

    rank: int
    file: str
    reason: str | None = None  # runner dumps: end, fault or timeout
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # pg name -> audit name
    members: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # pg name -> ranks
    enqueued: dict[str, int] = dataclasses.field(default_factory=dict)  # pg name -> last seq issued
    entries: dict[str, dict[int, FlightEntry]] = dataclasses.field(default_factory=dict)

    def entry(self, pg: str, seq: int) -> FlightEntry | None:
        return self.entries.get(pg, {}).get(seq)

    def pg_of(self, audit_name: str) -> str | None:
        return next((pg for pg, name in self.names.items() if name == audit_name), None)


def dump_paths(run_dir: RunDirs) -> list[tuple[int, Path]]:
    """(global rank, path) of every dump in the run's directories (`replay.rundirs`)."""
    return ranked_files([d for d in as_dirs(run_dir) if d.is_dir()], DUMP_FILE, "Flight Recorder dump")


def read_dumps(run_dir: RunDirs) -> dict[int, RankDump]:
    """Every dump of the run's directories by global rank ({} when there is none)."""
    return {rank: read_dump(path, rank) for rank, path in dump_paths(run_dir)}


def read_dump(path: Path, rank: int) -> RankDump:
    """One dump; `ReplayInputError` (one line, exit status 2) when it cannot be read as one."""
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise ReplayInputError(f"cannot read Flight Recorder dump {path}: {err}") from err
    if not isinstance(document, dict):
        raise ReplayInputError(f"{path}: a Flight Recorder dump is a JSON object")
    try:
        return _parse_dump(document, path, rank)
    except (LookupError, TypeError, ValueError, AttributeError) as err:
        raise ReplayInputError(f"{path}: malformed Flight Recorder dump ({type(err).__name__}: {err})") from None


def _parse_dump(document: dict, path: Path, rank: int) -> RankDump:
    dump = RankDump(rank, path.name)
    trace = document
    if "trace" in document:  # the runner's dump: torch's trace plus the audit names of its groups
        trace, dump.reason = document["trace"], document.get("reason")
        for name, group in (document.get("groups") or {}).items():
            dump.names[str(group["pg_name"])] = name
            dump.members[str(group["pg_name"])] = tuple(int(r) for r in group["ranks"])
    if not isinstance(trace, dict) or not isinstance(trace.get("entries", []), list):
        raise ReplayInputError(f"{path}: no Flight Recorder `entries` list (is it a torch FR JSON dump?)")
    for pg, ranks in _configured_members(trace.get("pg_config")).items():
        dump.members.setdefault(pg, ranks)
    pg_names: dict[str, str] = {}  # pg_status is keyed by pg_id, entries name their group
    for raw in trace.get("entries", []):
        if raw.get("is_p2p"):
            continue
        pg = str(raw["process_group"][0])
        pg_names[str(raw["pg_id"])] = pg
        entry = FlightEntry(int(raw["collective_seq_id"]), str(raw["profiling_name"]),
                            tuple(tuple(s) for s in raw.get("input_sizes", ())), bool(raw.get("retired")),
                            int(raw.get("time_created_ns", 0)), tuple(map(str, raw.get("input_dtypes", ()))))
        dump.entries.setdefault(pg, {})[entry.seq] = entry
        dump.enqueued[pg] = max(dump.enqueued.get(pg, 0), entry.seq)
    for pg_id, status in (trace.get("pg_status") or {}).items():
        pg = pg_names.get(str(pg_id))
        if pg is not None:  # the counter outlives entries evicted from the ring buffer
            dump.enqueued[pg] = max(dump.enqueued[pg], int(status.get("last_enqueued_collective", 0)))
    return dump


def _configured_members(pg_config) -> dict[str, tuple[int, ...]]:
    """{pg name: member ranks} from torch's `pg_config` ({name: {"desc", "ranks": "[0, 1]"}}).
    torch fills it where the backend registers its groups (NCCL); gloo in torch 2.13 leaves one
    entry with no name and no ranks, which says nothing."""
    members = {}
    for pg, config in (pg_config or {}).items():
        ranks = config.get("ranks")
        if isinstance(ranks, str):
            ranks = json.loads(ranks or "[]")
        if str(pg) and ranks:
            members[str(pg)] = tuple(int(r) for r in ranks)
    return members


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One process group across its members, as their Flight Recorders saw it."""

    pg: str
    name: str  # the audit name (dp, pcp, expert) or the pg name
    members: tuple[int, ...]
    enqueued: dict[int, int]  # rank -> last seq it issued (0: none)
    undumped: tuple[int, ...] = ()  # members (per the runner's dumps) that left no dump

    def first_difference(self) -> int | None:
        """The first seq some members issued and others did not (None when they agree)."""
        counts = set(self.enqueued.values())
        return min(counts) + 1 if len(counts) > 1 else None

    def behind(self, seq: int) -> tuple[int, ...]:
        return tuple(r for r in self.members if self.enqueued[r] < seq)

    def started(self, seq: int) -> tuple[int, ...]:
        return tuple(r for r in self.members if self.enqueued[r] >= seq)


def group_views(dumps: dict[int, RankDump]) -> list[GroupView]:
    """Every process group seen in the dumps; members from the runner's dumps when given, else
    the ranks whose dump shows the group."""
    members: dict[str, set[int]] = {}
    names: dict[str, str] = {}
    for rank, dump in dumps.items():
        for pg, ranks in dump.members.items():
            members.setdefault(pg, set()).update(ranks)
        for pg in dump.enqueued:
            members.setdefault(pg, set()).add(rank)
        names.update(dump.names)
    views = []
    for pg, ranks in sorted(members.items(), key=lambda item: (len(item[0]), item[0])):
        present = tuple(sorted(r for r in ranks if r in dumps))
        views.append(GroupView(pg, names.get(pg, f"pg {pg}"), present,
                               {r: dumps[r].enqueued.get(pg, 0) for r in present},
                               tuple(sorted(r for r in ranks if r not in dumps))))
    return views


def entry_text(dumps: dict[int, RankDump], view: GroupView, seq: int) -> str:
    """`gloo:all_reduce [[7, 2]]` as the members that issued collective `seq` recorded it."""
    labels = {e.label for r in view.started(seq) if (e := dumps[r].entry(view.pg, seq)) is not None}
    return " / ".join(sorted(labels)) or "a collective"


def in_flight(dumps: dict[int, RankDump], view: GroupView, seq: int) -> tuple[int, ...]:
    """Members whose collective `seq` was still in flight (not completed) when they dumped."""
    return tuple(r for r in view.started(seq)
                 if (e := dumps[r].entry(view.pg, seq)) is not None and not e.retired)


def describe(dumps: dict[int, RankDump], view: GroupView, seq: int) -> str:
    """Who started, completed or never started collective `seq` of `view`, in words."""
    started, waiting = view.started(seq), in_flight(dumps, view, seq)
    parts = [f"group {view.name} (pg {view.pg}, ranks {_ids(view.members)}) collective #{seq}"
             f" ({entry_text(dumps, view, seq)}):"]
    if waiting:
        parts.append(f"started and never completed by rank(s) {_ids(waiting)};")
    done = [r for r in started if r not in waiting]
    if done:
        parts.append(f"completed by rank(s) {_ids(done)};")
    behind = view.behind(seq)
    if behind:
        lasts = ", ".join(f"rank {r} at #{view.enqueued[r]}" for r in behind)
        parts.append(f"never started by rank(s) {_ids(behind)} (last issued: {lasts});")
    if view.undumped:
        parts.append(f"no dump from rank(s) {_ids(view.undumped)} (the process ended without writing one)")
    return " ".join(parts).rstrip(";")


def first_op_difference(dumps: dict[int, RankDump], view: GroupView) -> tuple[int, dict] | None:
    """The first seq that every member recorded but not as the same op, sizes and dtypes:
    (seq, {rank: entry})."""
    common = set.intersection(*(set(dumps[r].entries.get(view.pg, {})) for r in view.members)) \
        if view.members else set()
    for seq in sorted(common):
        entries = {r: dumps[r].entry(view.pg, seq) for r in view.members}
        if len({e.match_key for e in entries.values()}) > 1:
            return seq, entries
    return None


def divergence_verdicts(dumps: dict[int, RankDump]) -> list[Verdict]:
    """The Flight-Recorder-only judgement: per group, where its members part ways."""
    verdicts = []
    for view in group_views(dumps):
        differing = first_op_difference(dumps, view)  # before any later seq some never issued
        if differing is not None:
            verdicts.append(op_difference_verdict(view, *differing))
        seq = view.first_difference()
        if seq is not None:
            behind = view.behind(seq)
            verdicts.append(Verdict(
                "hang", None, None, f"first difference at #{seq}: {describe(dumps, view, seq)}; ranks behind:"
                f" {_ids(behind)}", behind, evidence=EVIDENCE))
    return verdicts


def op_difference_verdict(view: GroupView, seq: int, entries: dict[int, FlightEntry]) -> Verdict:
    """Members that issued collective `seq` as different ops or sizes. A strict majority is taken
    as what was expected and the others as the ranks that diverged; without one (two members, or
    no side larger than half) the Flight Recorder alone cannot tell which side diverged, and the
    verdict says so and names every side rather than guess."""
    sides: dict[tuple, list[int]] = {}
    for rank, entry in sorted(entries.items()):
        sides.setdefault(entry.match_key, []).append(rank)
    issued = "; ".join(f"rank(s) {_ids(rs)} issued {' / '.join(sorted({entries[r].label for r in rs}))}"
                       for rs in sides.values())
    where = f"group {view.name} (pg {view.pg}, ranks {_ids(view.members)}) collective #{seq}"
    majority = next((rs for rs in sides.values() if 2 * len(rs) > len(entries)), None)
    if majority is None:
        return Verdict("collective_mismatch", None, None,
                       f"first difference at #{seq}: {where} differs between ranks ({issued}); with no"
                       f" majority the Flight Recorder alone cannot tell which side diverged (a runner's"
                       f" audit logs, when the run left them, can)", tuple(sorted(entries)), evidence=EVIDENCE)
    odd = tuple(sorted(r for r in entries if r not in majority))
    return Verdict("collective_mismatch", None, None,
                   f"first difference at #{seq}: {where} differs between ranks ({issued}); rank(s)"
                   f" {_ids(odd)} diverged from the majority (gloo matched them with a different"
                   f" collective: a skipped or extra one)", odd, evidence=EVIDENCE)


def flight_only(run_dir: RunDirs) -> bool:
    """Directories of Flight Recorder dumps and no audit log: a plain PyTorch job."""
    if any(d.is_dir() and any(d.glob("rank-*.jsonl")) for d in as_dirs(run_dir)):
        return False  # audit logs: `discover` reads them (and refuses a rank found twice first)
    return bool(dump_paths(run_dir))


NO_MEMBERSHIP_NOTE = ("the dumps record no group membership (torch's gloo backend leaves pg_config empty):"
                      " the ranks are taken to be 0..{last} from the dumps' file names, so a missing dump of"
                      " a rank above {last} cannot be seen")


def named_ranks(dumps: dict[int, RankDump], world_size: int | None = None) -> dict[int, str]:
    """Every rank the dumps show to be in the job, with the evidence in words: the members of
    each group (the runner's group names, torch's pg_config), every rank below the highest one
    that dumped (global ranks count from 0) and, when the user gives it, every rank of the
    job's world size."""
    named: dict[int, str] = {rank: f"the job's world size is {world_size} (--world-size)"
                             for rank in range(world_size or 0)}
    for dump in sorted(dumps.values(), key=lambda d: d.rank):
        for pg, ranks in dump.members.items():
            for rank in ranks:
                named.setdefault(rank, f"{dump.file} lists it in group {dump.names.get(pg, f'pg {pg}')}"
                                       f" (ranks {_ids(ranks)})")
    last = max(dumps, default=-1)
    for rank in range(last + 1):
        named.setdefault(rank, f"rank {last} dumped, and global ranks count from 0")
    return named


def missing_dump_verdicts(dumps: dict[int, RankDump], named: dict[int, str] | None = None) -> list[Verdict]:
    """`missing_rank` for each rank the dumps (or `named`) name that left no dump of its own."""
    return [Verdict("missing_rank", None, None, f"rank {rank} left no Flight Recorder dump, though {why};"
                    f" what it issued cannot be compared with its peers", (rank,), f"fr-rank-{rank}.json",
                    evidence=EVIDENCE)
            for rank, why in sorted((named if named is not None else named_ranks(dumps)).items())
            if rank not in dumps]


def replay_flight_only(run_dir: RunDirs, world_size: int | None = None) -> ReplayReport:
    """Judge a run from its Flight Recorder dumps alone (no replicas known: `replica` is None);
    `world_size`: the job's, where the dumps cannot name every rank (gloo keeps no membership)."""
    dumps = read_dumps(run_dir)
    if world_size is not None and world_size < 1:
        raise ReplayInputError(f"--world-size must be a positive number of ranks, got {world_size}")
    outside = sorted(rank for rank in dumps if world_size is not None and rank >= world_size)
    if outside:
        raise ReplayInputError(f"{label(run_dir)}: dumps of rank(s) {_ids(outside)} lie outside --world-size"
                               f" {world_size}")
    entries = sum(len(seqs) for dump in dumps.values() for seqs in dump.entries.values())
    named = named_ranks(dumps, world_size)
    notes = ()
    if world_size is None and not any(dump.members for dump in dumps.values()):
        notes = (NO_MEMBERSHIP_NOTE.format(last=max(dumps)),)
    summary = RunSummary(label(run_dir), len(dumps), 0, 0, entries, None, None, len(named), notes)
    return ReplayReport(summary, sort_verdicts(missing_dump_verdicts(dumps, named) + divergence_verdicts(dumps)))


def _ids(ranks) -> str:
    return ", ".join(map(str, ranks))
