"""What a rule finds: one `Verdict` per finding, its kinds in root-cause order, and the names
findings give collectives (`dp all_reduce DRAFT_PREFILL`, `pcp all_gather phase 0`).

Verdicts are ordered so that the first one printed is the likeliest root cause: by step, then
by kind (a skipped collective before the hang or desync fault it caused), then by replica.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

# Kinds in the order a root cause precedes its consequences within one step.
KINDS = (
    "gap",  # a missing, repeated or unreadable record: everything after it is suspect
    "missing_rank",  # a rank the job's shape names left no log (or no Flight Recorder dump)
    "illegal_transition",
    "missing_replica",
    "collective_mismatch",
    "agreed_mismatch",
    "dispatch_mismatch",  # a replica sent another count than its logged batch yields
    "stale_context",  # a forward on a PCP context built for another batch
    "stale_buffer_replay",
    "replica_divergence",  # a rank of a replica took other step decisions than its TP/PCP peers
    "pcp_divergence",  # the PCP ranks of a replica sampled different tokens
    "graph_mode_demoted",  # an idle replica proposed eager where every replica could replay a graph
    "hang",
    "source_disagreement",  # the audit log and the Flight Recorder tell different stories
    "injection_not_fired",  # an injection the job record names never acted: the run tested nothing
    "fault",  # a fault the run logged itself
    "unfinished",  # a log that just stops: no shutdown, no fault, no hang to explain it
)
_KIND_ORDER = {kind: index for index, kind in enumerate(KINDS)}

# Faults that only relay a peer's fault: listed after the fault that caused them.
RELAYED_FAULTS = frozenset({"ReplicaFault", "DesyncError", "CollectiveTimeout", "EventRefused"})


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
    # each of `ranks` as {"rank", "dp", "pp", "pcp", "tp"[, "host"]}, and the dimensions its text names
    # (`replay.name_coordinates`, once the job's shape is known)
    coords: tuple[dict, ...] = dataclasses.field(default=(), compare=False)
    shown: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    # hang verdicts: the members of the collective that logged its `done` (went past it), which
    # a stop's rule asks about (`stops.StopRule.stopped_inside`); its text names their replicas
    past: tuple[int, ...] = dataclasses.field(default=(), compare=False)

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
        if self.coords:
            out["coords"] = [dict(c) for c in self.coords]
        return out

    def __str__(self) -> str:
        where = [f"step {self.step}" if self.step is not None else "no step"]
        if self.replica is not None:
            where.append(f"replica {self.replica}")
        if self.ranks:
            where.append(f"rank{'s' if len(self.ranks) > 1 else ''} {self._ranks_text()}")
        if self.file is not None:
            where.append(f"{self.file}:{self.line}" if self.line else self.file)
        return f"{self.kind} [{', '.join(where)}]: {self.detail}"

    def _ranks_text(self) -> str:
        """'2, 3', or with coordinates '5 (pcp 0, tp 1), 7 (pcp 1, tp 1)' in the dimensions `shown`."""
        if not self.shown or not self.coords:
            return _join(self.ranks)
        return ", ".join(f"{c['rank']} (" + ", ".join(f"{d} {c[d]}" for d in self.shown) + ")" for c in self.coords)


def sort_verdicts(verdicts: Iterable[Verdict]) -> tuple[Verdict, ...]:
    return tuple(sorted(verdicts, key=Verdict.sort_key))


def _join(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))


def phase_label(group: str, phase) -> str:
    # Phases are the step phases of DESIGN section 5 in every group that logs them (the
    # expert group's forward runs in TARGET, its draft forwards in DRAFT_*). Imported here,
    # on the path that formats a finding, so that a sound replay never loads torch (dp's import).
    from runner_fsm.dp import PHASE_NAMES

    if group in ("dp", "expert") and phase in PHASE_NAMES:
        return PHASE_NAMES[phase]
    return f"phase {phase}"


def label(group: str, op: str, phase) -> str:
    return f"{group} {op} {phase_label(group, phase)}"


def key_label(group: str, key: tuple) -> str:
    """A sequence key (op, phase, shapes) as text."""
    op, phase, shapes = key
    text = f"{op} {phase_label(group, phase)}"
    return text if shapes is None else f"{text} {_shapes_text(shapes)}"


def sequence_label(group: str, keys) -> str:
    return "[" + ", ".join(key_label(group, key) for key in keys) + "]" if keys else "nothing"


def _shapes_text(shapes) -> str:
    if isinstance(shapes, tuple):
        return "[" + ", ".join(_shapes_text(s) for s in shapes) + "]"
    return str(shapes)
