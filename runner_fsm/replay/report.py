"""What replay reports: the `ReplayReport` listing a run's verdicts (`rules.verdicts`, text and
JSON), and the run as a picture (`Timeline`, `plot`).

The picture has one lane per rank, each step coloured by its state and findings marked;
steps are counted into bins whose width doubles whenever there are too many, so a run of
any length costs the same memory (`MAX_BINS` per rank). matplotlib is an optional extra
(`pip install matplotlib`), imported only to draw.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from runner_fsm.errors import ReplayInputError
from runner_fsm.replay.coverage import coverage_lines, sound_line
from runner_fsm.rules.verdicts import KINDS, Verdict

if TYPE_CHECKING:
    from runner_fsm.rules.rank_steps import RankStep


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What was read: identical however often the same run directory is judged."""

    run_dir: str
    ranks: int
    replicas: int
    pcp_size: int
    records: int
    first_step: int | None
    last_step: int | None
    expected_ranks: int | None = None  # the ranks the job's shape names (None: not recorded)
    notes: tuple[str, ...] = ()  # what the judgement could not rest on, in words
    tp_size: int = 1
    pp_size: int = 1
    window: tuple[int, int] | None = None  # the steps judged (`--last`, `--steps`); None: every step
    log_steps: tuple[int, int] | None = None  # the first and last step the logs hold
    rotated: tuple = ()  # `coverage.Rotated`: steps capped logs no longer hold, with their ranks


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """The verdicts of one run, sorted root cause first; sound when there are none."""

    summary: RunSummary
    verdicts: tuple[Verdict, ...]

    @property
    def sound(self) -> bool:
        return not self.verdicts

    @property
    def exit_code(self) -> int:
        return 0 if self.sound else 1

    def counts(self) -> dict[str, int]:
        counted = collections.Counter(v.kind for v in self.verdicts)
        return {kind: counted[kind] for kind in KINDS if counted[kind]}

    def as_dict(self) -> dict[str, Any]:
        summary = dataclasses.asdict(self.summary)
        summary["notes"] = list(self.summary.notes)
        summary["rotated"] = [span.as_dict() for span in self.summary.rotated]
        summary.update(sound=self.sound, findings=len(self.verdicts), counts=self.counts())
        return {"summary": summary, "verdicts": [v.as_dict() for v in self.verdicts]}

    def format(self, *, limit: int = 20) -> str:
        s = self.summary
        steps = "no steps" if s.first_step is None else f"steps {s.first_step}..{s.last_step}"
        ranks = f"{s.ranks} ranks" if s.expected_ranks in (None, s.ranks) else f"{s.ranks} of {s.expected_ranks} ranks"
        if s.replicas:
            inner = "".join(f" x {size} {name}" for name, size in (("PP", s.pp_size), ("TP", s.tp_size)) if size > 1)
            head = (f"replay {s.run_dir}: {ranks} ({s.replicas} replicas x {s.pcp_size} PCP{inner}),"
                    f" {steps}, {s.records} records")
        else:  # Flight Recorder dumps alone: no replicas, no steps, one record per collective
            head = f"replay {s.run_dir}: {ranks} (Flight Recorder dumps only), {s.records} collectives"
        head += "".join(f"\nnote: {note}" for note in s.notes)
        head += "".join(f"\n{line}" for line in coverage_lines(s.window, s.log_steps, s.rotated, s.ranks))
        if self.sound:
            return f"{head}\n{sound_line(s.window, s.first_step, s.last_step, s.rotated)}"
        lines = [head, f"UNSOUND: {len(self.verdicts)} finding(s); first: {self.verdicts[0]}"]
        lines += [f"  {index}. {v}" for index, v in enumerate(self.verdicts[:limit], start=1)]
        if len(self.verdicts) > limit:
            lines.append(f"  ... {len(self.verdicts) - limit} more (use --json for all)")
        lines.append("counts: " + ", ".join(f"{kind} {n}" for kind, n in self.counts().items()))
        return "\n".join(lines)


STATES = ("prefill", "decode", "idle_dummy", "no step")
_STATE_INDEX = {"prefill": 0, "decode": 1, "idle": 2}
COLOURS = ("tab:blue", "tab:green", "lightgrey", "white")
MAX_BINS = 2048
MAX_MARKS = 500  # more marks than this draw as noise, not information
MARK_STYLES = {"fault": ("X", "red"), "hang": ("v", "darkred"), "gap": ("s", "black"),
               "stale_buffer_replay": ("D", "purple"), "illegal_transition": ("P", "brown")}
MARKED_KINDS = ("fault", "hang", "gap", "missing_replica", "collective_mismatch", "agreed_mismatch",
                "illegal_transition", "stale_buffer_replay")


def require_matplotlib():
    """The pyplot module, or `ReplayInputError` telling how to install it (exit code 2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as pyplot
    except ImportError as err:
        raise ReplayInputError(
            f"--plot needs matplotlib, which is not installed ({err});"
            " run `pip install matplotlib` (or `pip install 'runner-fsm[plot]'`)") from err
    return pyplot


class Timeline:
    """Per-rank counts of step states in adaptive bins of `width` steps."""

    def __init__(self, ranks):
        self.ranks = tuple(sorted(ranks))
        self.origin: int | None = None
        self.width = 1
        self.bins: dict[int, dict[int, list[int]]] = {rank: {} for rank in self.ranks}
        self.last_step: int | None = None

    def add(self, step: int, present: dict[int, RankStep]) -> None:
        if self.origin is None:
            self.origin = step
        self.last_step = step
        index = (step - self.origin) // self.width
        if index >= MAX_BINS:
            self._coarsen()
            index = (step - self.origin) // self.width
        for rank, summary in present.items():
            counts = self.bins[rank].get(index)
            if counts is None:
                counts = self.bins[rank][index] = [0, 0, 0]
            state = _STATE_INDEX.get(summary.kind)
            if state is not None:
                counts[state] += 1

    def _coarsen(self) -> None:
        self.width *= 2
        for rank, bins in self.bins.items():
            merged: dict[int, list[int]] = {}
            for index, counts in bins.items():
                into = merged.setdefault(index // 2, [0, 0, 0])
                for state, count in enumerate(counts):
                    into[state] += count
            self.bins[rank] = merged

    def lanes(self):
        """Per rank: [(first_step, steps, state_index)] runs of bins of one dominant state."""
        out = {}
        for rank, bins in self.bins.items():
            runs: list[list[int]] = []
            for index in sorted(bins):
                counts = bins[index]
                state = max(range(3), key=counts.__getitem__) if any(counts) else 3
                start = self.origin + index * self.width
                if runs and runs[-1][2] == state and runs[-1][0] + runs[-1][1] == start:
                    runs[-1][1] += self.width
                else:
                    runs.append([start, self.width, state])
            out[rank] = runs
        return out


def plot(timeline: Timeline, verdicts: tuple[Verdict, ...], path: str | os.PathLike[str], title: str) -> None:
    pyplot = require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = timeline.lanes()
    figure, axes = pyplot.subplots(figsize=(12, 1.6 + 0.45 * len(lanes)))
    for row, rank in enumerate(timeline.ranks):
        for state in range(len(STATES) - 1):  # "no step" stays blank
            spans = [(start, width) for start, width, s in lanes[rank] if s == state]
            if spans:
                axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[state], edgecolor="none",
                                 linewidth=0, antialiased=False)  # no seams between bins
    marked = _mark_findings(axes, timeline, verdicts)
    axes.set_yticks(range(len(timeline.ranks)), [f"rank {r}" for r in timeline.ranks])
    axes.invert_yaxis()
    axes.set_xlabel(f"step (one bin = {timeline.width} step{'s' if timeline.width > 1 else ''})")
    axes.set_title(title)
    handles = [Patch(facecolor=COLOURS[i], label=STATES[i]) for i in range(len(STATES) - 1)]
    handles += [Line2D([], [], marker=marker, color=colour, linestyle="none", label=kind)
                for kind, (marker, colour) in marked.items()]
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(lanes) < 4 else -0.15),
                ncol=min(len(handles), 6), fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _mark_findings(axes, timeline: Timeline, verdicts) -> dict[str, tuple[str, str]]:
    """Mark each finding on the lanes of its ranks; the styles used, by kind, for the legend."""
    rows = {rank: row for row, rank in enumerate(timeline.ranks)}
    used: dict[str, tuple[str, str]] = {}
    for verdict in [v for v in verdicts if v.kind in MARKED_KINDS and v.step is not None][:MAX_MARKS]:
        style = used[verdict.kind] = MARK_STYLES.get(verdict.kind, ("o", "orange"))
        for rank in verdict.ranks:
            if rank in rows:
                axes.plot(verdict.step, rows[rank], marker=style[0], color=style[1], markersize=9,
                          linestyle="none")
    return used
