"""What the replay checker finds: one `Verdict` per finding, and the report that lists them.

Verdicts are ordered so that the first one printed is the likeliest root cause: by step, then
by kind (a skipped collective before the hang or desync fault it caused), then by replica.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

from runner_fsm.errors import RunnerError

# Kinds in the order a root cause precedes its consequences within one step.
KINDS = (
    "gap",  # a missing, repeated or unreadable record: everything after it is suspect
    "illegal_transition",
    "missing_replica",
    "collective_mismatch",
    "agreed_mismatch",
    "stale_buffer_replay",
    "hang",
    "source_disagreement",  # the audit log and the Flight Recorder tell different stories
    "fault",  # a fault the run logged itself
    "unfinished",  # a log that just stops: no shutdown, no fault, no hang to explain it
)
_KIND_ORDER = {kind: index for index, kind in enumerate(KINDS)}

# Faults that only relay a peer's fault: listed after the fault that caused them.
RELAYED_FAULTS = frozenset({"ReplicaFault", "DesyncError", "CollectiveTimeout", "EventRefused"})


class ReplayInputError(RunnerError):
    """The run directory cannot be judged at all (missing, unreadable, no rank files)."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One finding; `replica` is the DP rank to blame, `ranks` the global ranks involved."""

    kind: str
    replica: int | None
    step: int | None
    detail: str
    ranks: tuple[int, ...] = ()
    file: str | None = None
    line: int | None = None
    error: str | None = None  # fault verdicts: the logged error type
    evidence: tuple[str, ...] = ("audit",)  # sources the verdict rests on (audit, flight_recorder)

    def __post_init__(self) -> None:
        if self.kind not in _KIND_ORDER:
            raise ValueError(f"unknown verdict kind {self.kind!r}; known: {', '.join(KINDS)}")

    def sort_key(self) -> tuple:
        relayed = self.error in RELAYED_FAULTS
        return (
            -2 if self.step is None else self.step,
            _KIND_ORDER[self.kind],
            relayed,
            -1 if self.replica is None else self.replica,
            self.ranks,
            self.line or 0,
        )

    def as_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "replica": self.replica, "step": self.step, "detail": self.detail,
               "ranks": list(self.ranks)}
        if self.file is not None:
            out["file"], out["line"] = self.file, self.line
        if self.error is not None:
            out["error"] = self.error
        out["evidence"] = list(self.evidence)
        return out

    def __str__(self) -> str:
        where = [f"step {self.step}" if self.step is not None else "no step"]
        if self.replica is not None:
            where.append(f"replica {self.replica}")
        if self.ranks:
            where.append(f"rank{'s' if len(self.ranks) > 1 else ''} {_join(self.ranks)}")
        if self.file is not None:
            where.append(f"{self.file}:{self.line}" if self.line else self.file)
        return f"{self.kind} [{', '.join(where)}]: {self.detail}"


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
        summary.update(sound=self.sound, findings=len(self.verdicts), counts=self.counts())
        return {"summary": summary, "verdicts": [v.as_dict() for v in self.verdicts]}

    def format(self, *, limit: int = 20) -> str:
        s = self.summary
        steps = "no steps" if s.first_step is None else f"steps {s.first_step}..{s.last_step}"
        head = (f"replay {s.run_dir}: {s.ranks} ranks ({s.replicas} replicas x {s.pcp_size} PCP),"
                f" {steps}, {s.records} records")
        if self.sound:
            return f"{head}\nSOUND: no findings"
        lines = [head, f"UNSOUND: {len(self.verdicts)} finding(s); first: {self.verdicts[0]}"]
        lines += [f"  {index}. {v}" for index, v in enumerate(self.verdicts[:limit], start=1)]
        if len(self.verdicts) > limit:
            lines.append(f"  ... {len(self.verdicts) - limit} more (use --json for all)")
        lines.append("counts: " + ", ".join(f"{kind} {n}" for kind, n in self.counts().items()))
        return "\n".join(lines)


def sort_verdicts(verdicts: Iterable[Verdict]) -> tuple[Verdict, ...]:
    return tuple(sorted(verdicts, key=Verdict.sort_key))


def _join(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))
