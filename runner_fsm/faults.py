"""Fault injection: reproduce, on purpose, the hand-off bugs the runner exists to catch.

`runner-fsm run --inject KIND@replica=R,step=S` makes replica R misbehave at step S
(`...,rank=K`: only its rank K, for the kinds that make one rank disagree with its peers).
Each kind breaks one rule of DESIGN.md section 6; the online checks must stop every
process with a typed error naming R and S, and `runner-fsm replay` must name them too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

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
    # One rank of the replica decides otherwise than its peers (`KIND@replica=R,step=S,rank=K`):
    "tp-skip-draft",  # rank K skips its drafter's forwards for the step (vLLM #49027)
    "rank-graph-mode",  # rank K takes the other graph/eager mode for the step (SGLang #31566)
    # The idle replica proposes eager where it could replay a graph: every replica runs eager
    # (vllm-ascend #15347); `graph_mode_demoted` in replay.
    "demote-graph-mode",
)
# Kinds that act on one rank of the replica: `rank=K` (K: the rank within the replica, in vLLM's
# order; in the embedded engine, whose replicas have no TP or PP, its PCP rank) is required.
RANK_KINDS = frozenset({"tp-skip-draft", "rank-graph-mode"})

_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@replica=(?P<replica>\d+),step=(?P<step>\d+)(,rank=(?P<rank>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Injection:
    """One fault: `kind` on replica `replica` at step `step`; identical on every rank."""

    kind: str
    replica: int
    step: int
    rank: int | None = None  # the rank within the replica it acts on (None: every rank of it)

    @classmethod
    def parse(cls, text: str) -> "Injection":
        match = _SPEC.match(text.strip())
        if not match:
            raise ConfigError(f"--inject expects KIND@replica=R,step=S[,rank=K], got {text!r}")
        kind = match["kind"]
        if kind not in KINDS:
            raise ConfigError(f"unknown fault kind {kind!r}; known kinds: {', '.join(KINDS)}")
        rank = None if match["rank"] is None else int(match["rank"])
        if (kind in RANK_KINDS) != (rank is not None):
            raise ConfigError(f"--inject {text.strip()}: {kind} " + (
                "acts on one rank of the replica: add ,rank=K" if rank is None else "takes no rank=K"))
        return cls(kind, int(match["replica"]), int(match["step"]), rank)

    def __str__(self) -> str:
        rank = "" if self.rank is None else f",rank={self.rank}"
        return f"{self.kind}@replica={self.replica},step={self.step}{rank}"


def parse_target(text: str) -> tuple[int, int] | None:
    """(replica, step) of `KIND@replica=R,step=S` whatever the kind (the vLLM worker's kinds are
    its own, `integrations.vllm.inject`); None when the text is not of that form."""
    match = _SPEC.match(str(text).strip())
    return (int(match["replica"]), int(match["step"])) if match else None


class Injector:
    """Answers, at each decision point, whether a fault is due on this replica now, and
    remembers which injections it applied (`fired`), so that one that never applied is said."""

    def __init__(self, injections: Iterable[Injection] = (), *,
                 on_fire: Callable[[Injection], None] | None = None):
        """`on_fire(injection)`: called once, the first time an injection applies (the audit
        log's `injected` record: the evidence replay reads that it fired)."""
        self.injections = tuple(injections)
        self.fired: set[Injection] = set()
        self._on_fire = on_fire

    def due(self, kind: str, dp_rank: int, step_id: int, rank: int | None = None) -> bool:
        """`rank`: this process's rank within its replica, where `kind` acts on one rank only."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        for injection in self.injections:
            if injection.kind == kind and injection.replica == dp_rank and injection.step == step_id \
                    and injection.rank in (None, rank):
                if injection not in self.fired and self._on_fire is not None:
                    self._on_fire(injection)
                self.fired.add(injection)
                return True
        return False

    def not_fired(self, dp_rank: int) -> tuple[Injection, ...]:
        """This replica's injections that never applied."""
        return tuple(i for i in self.injections if i.replica == dp_rank and i not in self.fired)


# What a step must be for each kind to apply, beyond being replica R's step S.
_NEEDS_REAL = frozenset({"wrong-dispatch-count", "pcp-divergence"})
_NEEDS_DUMMY = frozenset({"skip-dummy-forward", "skip-buffer-refresh", "stale-pcp-context", "demote-graph-mode"})


def why_not_fired(injection: Injection, seen: tuple[str, bool] | None, last_step: int | None) -> str:
    """Why `injection` never applied, in words. `seen`: (state, all_idle) of its replica at its
    step (state prefill, decode or idle_dummy; all_idle: every replica was idle), None when the
    replica never ran that step; `last_step`: the replica's last step."""
    r, s = injection.replica, injection.step
    if seen is None:
        ended = f"its run ended at step {last_step}" if last_step is not None else "it ran no step"
        return f"replica {r} never reached step {s}: {ended}"
    state, all_idle = seen
    if injection.kind in _NEEDS_REAL and state == "idle_dummy":
        return f"replica {r} was idle at step {s} ({injection.kind} applies to a step that runs a batch)"
    if injection.kind in _NEEDS_DUMMY and state != "idle_dummy":
        return f"replica {r} was not idle at step {s} (it ran a {state} step; {injection.kind} applies to a dummy step)"
    if all_idle:
        return f"every replica was idle at step {s}, so no forward ran"
    if injection.kind == "stale-pcp-context":
        return f"replica {r} had run no real batch before step {s}, so it had no saved PCP context to reuse"
    return f"replica {r} ran a {state} step at step {s}, where {injection.kind} found nothing to act on"


def static_problem(injection: Injection, dp_size: int, pcp_size: int, spec_tokens: int) -> str | None:
    """Why `injection` can never apply in a run of this shape (None: it may)."""
    if injection.replica >= dp_size:
        return f"--inject {injection}: there is no replica {injection.replica} (dp_size is {dp_size})"
    if injection.kind == "skip-draft-sync" and spec_tokens < 1:
        return f"--inject {injection}: the run drafts nothing (num_speculative_tokens=0), so there is no draft sync to skip"
    if injection.kind == "draft-count-mismatch" and spec_tokens < 2:
        return (f"--inject {injection}: needs num_speculative_tokens >= 2 (a draft-decode forward to drop),"
                f" got {spec_tokens}")
    if injection.kind == "pcp-divergence" and pcp_size < 2:
        return f"--inject {injection}: needs pcp_size >= 2 (PCP ranks to diverge), got {pcp_size}"
    if injection.rank is not None and injection.rank >= pcp_size:
        return (f"--inject {injection}: there is no rank {injection.rank} in replica {injection.replica}"
                f" (its ranks are its {pcp_size} PCP rank(s))")
    if injection.kind == "tp-skip-draft" and spec_tokens < 1:
        return f"--inject {injection}: the run drafts nothing (num_speculative_tokens=0), so there is no drafter to skip"
    if injection.kind == "wrong-dispatch-count" and pcp_size < 2:
        return (f"--inject {injection}: needs pcp_size >= 2 (with one PCP rank the global token count is"
                f" the PCP-local one: nothing would be wrong), got {pcp_size}")
    return None


NO_FAULTS = Injector()
