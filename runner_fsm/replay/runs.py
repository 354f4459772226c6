"""A folder of several runs, for `runner-fsm replay`: each run found, judged on its own, one line each.

`make demo` leaves three runs in `runs/demo/logs/<stamp>-dp<D>-pcp<P>-k<K>-<mode>/`; `runner-fsm
replay runs/demo` (or `runs/demo/logs/*`) lists them with a verdict each: SOUND, or the count of
findings by kind (`replay RUN` of that run tells them).

Which directories are one run (`find_runs`):
- a directory holding rank logs (`rank-<g>.jsonl`, its segments) or Flight Recorder dumps is a
  run, judged as before; a folder holding neither is searched below for such directories (not
  below one: a run's directory holds no other run);
- directories are one run when they are the nodes of one job (`rundirs`): the same `run_id` and
  job shape in their `job` records, the same job hosts where those records list them, and ranks
  that do not overlap. The run id alone does not tell runs apart (the embedded engine names every
  run `run`): two directories that both hold rank 0 are two runs;
- directories named one by one stay one run (judged, or refused, as before) unless they are
  several runs that each hold every rank their shape names (`replay runs/demo/logs/*`): the nodes
  of one job are never each whole, so a job given node by node is still judged as one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from runner_fsm.audit.shape import JobShape
from runner_fsm.errors import ReplayInputError, RunnerError
from runner_fsm.replay.coverage import resolve_window
from runner_fsm.replay.discover import RANK_FILE, Run
from runner_fsm.replay.flight import DUMP_FILE
from runner_fsm.replay.judge import replay
from runner_fsm.replay.report import ReplayReport
from runner_fsm.replay.rundirs import RunDirs, as_dirs, label


@dataclasses.dataclass(frozen=True)
class FoundRun:
    """Directories judged together as one run, and what their logs say of it."""

    dirs: tuple[Path, ...]
    run_id: str | None = None
    shape: JobShape | None = None  # None: its logs declare none (an older writer), or cannot be read
    ranks: frozenset[int] = frozenset()
    hosts: dict | None = dataclasses.field(default=None, compare=False)  # the job's {host: [ranks]}, if listed
    error: str | None = None  # its logs cannot be read as a run: replay would exit 2
    found: Run | None = dataclasses.field(default=None, compare=False)  # its ranks, when one directory holds it

    @property
    def label(self) -> str:
        return label(self.dirs)

    @property
    def whole(self) -> bool:
        """Every rank its shape names has a log here."""
        return self.shape is not None and self.ranks == frozenset(range(self.shape.world_size))


def find_runs(run_dir: RunDirs) -> list[FoundRun] | None:
    """The runs `run_dir` holds when it holds several (see the module docstring); None when it
    names one run, or nothing a run can be found in: replay judges it as it always has."""
    dirs = as_dirs(run_dir)
    if len(dirs) == 1:
        if not dirs[0].is_dir() or holds_run(dirs[0]):
            return None
        below = run_dirs_below(dirs[0])
        return group_runs([read_run(d) for d in below]) if below else None
    runs = group_runs([read_run(d) for d in dirs])
    return runs if len(runs) > 1 and all(run.whole for run in runs) else None


def holds_run(directory: Path) -> bool:
    """Whether `directory` holds rank logs or Flight Recorder dumps (unlistable: say so, and let
    replay report why)."""
    try:
        return any(RANK_FILE.match(name) or DUMP_FILE.match(name) for name in os.listdir(directory))
    except OSError:
        return True


def run_dirs_below(root: Path) -> list[Path]:
    """The run directories below `root`, by path; none inside a run directory. Links to
    directories are not followed: a run linked in from elsewhere is not this folder's."""
    found = []
    for here, subdirs, files in os.walk(root):
        if any(RANK_FILE.match(name) or DUMP_FILE.match(name) for name in files):
            found.append(Path(here))
            subdirs.clear()
    return sorted(found)


def read_run(directory: Path) -> FoundRun:
    """One directory as a run: its ranks, run id, shape and hosts from its logs' first records."""
    try:
        run = Run.find(directory)
    except ReplayInputError as err:
        return FoundRun((directory,), error=str(err))
    infos = run.ranks
    job = infos[0].segments[0].job if infos[0].segments else None
    run_id = job.get("run_id") if isinstance(job, dict) else None
    return FoundRun((directory,), run_id if isinstance(run_id, str) else None,
                    next((info.shape for info in infos if info.shape is not None), None),
                    frozenset(info.global_rank for info in infos),
                    next((info.hosts for info in infos if info.hosts), None), found=run)


def group_runs(found: list[FoundRun]) -> list[FoundRun]:
    """`found` (one directory each) with the nodes of one job joined, in the order given."""
    runs: list[FoundRun] = []
    for one in found:
        place = next((i for i, run in enumerate(runs) if _one_job(run, one)), None)
        if place is None:
            runs.append(one)
        else:
            run = runs[place]
            runs[place] = dataclasses.replace(run, dirs=run.dirs + one.dirs, ranks=run.ranks | one.ranks,
                                              hosts=run.hosts or one.hosts, found=None)  # found anew, whole
    return runs


def _one_job(a: FoundRun, b: FoundRun) -> bool:
    """Whether `a` and `b` are nodes of one job (see the module docstring)."""
    return (a.error is None and b.error is None and a.run_id is not None and a.run_id == b.run_id
            and a.shape is not None and a.shape == b.shape and not a.ranks & b.ranks
            and (a.hosts is None or b.hosts is None or a.hosts == b.hosts))


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One run's report, or why it cannot be judged."""

    run: FoundRun
    report: ReplayReport | None
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return 2 if self.report is None else self.report.exit_code

    def line(self) -> str:
        """'<dirs>: run_id <id>, <n> ranks: SOUND', or the findings counted by kind."""
        if self.report is None:
            return f"{self.run.label}: UNREADABLE: {self.error}"
        s = self.report.summary
        ranks = f"{s.ranks} rank{'s' if s.ranks != 1 else ''}"
        if s.expected_ranks not in (None, s.ranks):
            ranks = f"{s.ranks} of {s.expected_ranks} ranks"
        head = f"{self.run.label}: run_id {self.run.run_id or '-'}, {ranks}"
        if self.report.sound:
            return f"{head}: SOUND"
        counts = ", ".join(f"{n} {kind}" for kind, n in self.report.counts().items())
        return f"{head}: {len(self.report.verdicts)} finding{'s' if len(self.report.verdicts) != 1 else ''}: {counts}"

    def as_dict(self) -> dict:
        out = {"run": self.run.label, "dirs": [str(d) for d in self.run.dirs], "run_id": self.run.run_id,
               "exit_code": self.exit_code}
        if self.report is None:
            return {**out, "error": self.error}
        return {**out, **self.report.as_dict()}


def judge_runs(runs: list[FoundRun], *, jobs: int | None = None, steps: tuple[int, int] | None = None,
               last: int | None = None) -> list[RunOutcome]:
    """Each run replayed on its own (`replay.replay`), in order; one that cannot be read is an
    outcome of its own, not the end of the others."""
    outcomes = []
    for run in runs:
        if run.error is not None:
            outcomes.append(RunOutcome(run, None, run.error))
            continue
        try:
            outcomes.append(RunOutcome(run, replay(run.found or run.dirs, jobs=jobs, steps=steps, last=last)))
        except (RunnerError, OSError) as err:
            outcomes.append(RunOutcome(run, None, " ".join(str(err).split())))
    return outcomes


def print_runs(run_dir: RunDirs, runs: list[FoundRun], *, as_json: bool = False, jobs: int | None = None,
               steps: tuple[int, int] | None = None, last: int | None = None, plot: str | None = None,
               perfetto: str | None = None, world_size: int | None = None) -> int:
    """Judge `runs` and print one line per run (`as_json`: a list of per-run reports); the exit
    status: 0 every run sound, 1 findings in any, 2 any that cannot be read. What draws or sizes
    one run (`plot`, `perfetto`, `world_size`) is refused: name the run instead."""
    for flag, value in (("--plot", plot), ("--perfetto", perfetto), ("--world-size", world_size)):
        if value is not None:
            raise ReplayInputError(f"{flag} is for one run; {_where(run_dir)} {len(runs)} runs"
                                   f" ({', '.join(run.label for run in runs)}): give one of them")
    try:
        resolve_window(None, steps=steps, last=last)  # a bad window is the user's, not every run's
    except ValueError as err:
        raise ReplayInputError(str(err)) from None
    outcomes = judge_runs(runs, jobs=jobs, steps=steps, last=last)
    if as_json:
        print(json.dumps([outcome.as_dict() for outcome in outcomes], indent=1))
    else:
        print(f"replay: {_where(run_dir)} {len(runs)} run{'s' if len(runs) != 1 else ''}")
        for outcome in outcomes:
            print(f"  {outcome.line()}")
        if any(outcome.exit_code for outcome in outcomes):
            print("each run's findings: runner-fsm replay <its directories>")
    return max(outcome.exit_code for outcome in outcomes)


def _where(run_dir: RunDirs) -> str:
    """'runs/demo holds', or 'the 3 directories given are' (their names are in each run's line)."""
    dirs = as_dirs(run_dir)
    return f"{dirs[0]} holds" if len(dirs) == 1 else f"the {len(dirs)} directories given are"
