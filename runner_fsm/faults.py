"""Fault injection: reproduce, on purpose, the hand-off bugs the runner exists to catch.

`runner-fsm run --inject KIND@replica=R,step=S` makes replica R misbehave at step S.
Each kind breaks one rule of DESIGN.md section 6; the online checks must stop every
process with a typed error naming R and S, and `runner-fsm replay` must name them too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from runner_fsm.errors import ConfigError

KINDS = (
    "skip-draft-sync",  # the replica skips its draft agreements
    "skip-dummy-forward",  # the idle replica agrees but runs no dummy forward
    "skip-buffer-refresh",  # the idle replica replays with the real batch's buffers
    "stale-pcp-context",  # the idle replica reuses the saved real PCP context
    "wrong-dispatch-count",  # reports the global token count, not the PCP-local one
    "crash",  # the process exits at the start of the step
    "hang",  # the process stops before its next collective
    "pcp-divergence",  # one PCP rank of the replica samples another token than its peers
    "draft-count-mismatch",  # the replica runs one draft-decode forward fewer than agreed
    "corrupt-agreement",  # the replica's copy of the agreed result is altered after the all-reduce
)

_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@replica=(?P<replica>\d+),step=(?P<step>\d+)$")


@dataclasses.dataclass(frozen=True)
class Injection:
    """One fault: `kind` on replica `replica` at step `step`; identical on every rank."""

    kind: str
    replica: int
    step: int

    @classmethod
    def parse(cls, text: str) -> "Injection":
        match = _SPEC.match(text.strip())
        if not match:
            raise ConfigError(f"--inject expects KIND@replica=R,step=S, got {text!r}")
        kind = match["kind"]
        if kind not in KINDS:
            raise ConfigError(f"unknown fault kind {kind!r}; known kinds: {', '.join(KINDS)}")
        return cls(kind, int(match["replica"]), int(match["step"]))

    def __str__(self) -> str:
        return f"{self.kind}@replica={self.replica},step={self.step}"


class Injector:
    """Answers, at each decision point, whether a fault is due on this replica now."""

    def __init__(self, injections: Iterable[Injection] = ()):
        self.injections = tuple(injections)

    def due(self, kind: str, dp_rank: int, step_id: int) -> bool:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        return any(i.kind == kind and i.replica == dp_rank and i.step == step_id for i in self.injections)


NO_FAULTS = Injector()
