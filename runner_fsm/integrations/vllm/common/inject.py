"""Faults for the vLLM worker: `KIND@replica=R,step=S`, the worker option `inject`
(`additional_config={"runner_fsm": {"inject": ...}}`, else `RUNNER_FSM_INJECT`).

Each kind reproduces a DP hand-off bug seen in vLLM and vLLM-Ascend; the online checks must
stop every rank naming R and S, and `runner-fsm replay` must name them too. The PCP kinds act
in MRV2's PCP manager (`runners/pcp/evidence.py`) and have no online check: replay names them from the
PCP evidence. Step ids count
the worker's steps from 0. The syntax is the embedded engine's (`runner_fsm.faults`); the
kinds differ, since they act on vLLM's own calls.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from runner_fsm.errors import ConfigError
from runner_fsm.faults import Injection

KINDS = (
    "skip-dummy-forward",  # the idle replica agrees, then returns without its dummy forward
    "skip-draft-sync",  # the idle replica skips the drafter's dummy run (vLLM issue #35294)
    "draft-steps-mismatch",  # the idle replica's drafter runs one draft step more (vllm-ascend #12036)
    "desync",  # the replica reports the next step id in its agreement rows
    # MRV2's PCP manager (`runners/pcp/evidence.py`), the hand-off bugs vLLM-Ascend's "Adapt PCP for DP" fixed:
    "stale-pcp-context",  # the idle replica's dummy reads the last real batch's PCP slot mappings
    "skip-buffer-refresh",  # the dummy runs over the PCP input buffers the last real batch left
    "wrong-dispatch-count",  # the global token count sent where the PCP-local one is due
    # One rank of the replica (`KIND@replica=R,step=S,rank=K`, K its rank within the replica in
    # vLLM's order), `replica_check`:
    "tp-skip-draft",  # rank K's drafter gate alone says no for the step (vLLM #49027)
    # A FULL graph's replay (`graph_faults`; MRV2's graph manager, e.g. under the device emulation):
    "skip-input-refresh",  # the replay reads the inputs the step before left: its own were never written there
    "rank-graph-mode",  # rank K runs the step eager while its peers replay (SGLang #31566, #37933)
    # The DP sync (`dp/support.py`): the idle replica asks for eager, so every replica runs eager
    # (vllm-ascend #15347); `graph_mode_demoted` in replay.
    "demote-graph-mode",
)
RANK_KINDS = frozenset({"tp-skip-draft", "rank-graph-mode"})
# Kinds that act at a graph replay (`graph_faults.GraphFaults` owns them, whatever the job's shape).
GRAPH_KINDS = frozenset({"skip-input-refresh", "rank-graph-mode"})


def parse(text: str) -> Injection:
    # The embedded parser knows the embedded kinds only: parse the shared syntax with a
    # known kind in its place, then check ours (the rank kinds are the embedded engine's too).
    kind, sep, rest = text.strip().partition("@")
    if kind not in KINDS or not sep:
        raise ConfigError(f"inject expects KIND@replica=R,step=S[,rank=K] with KIND one of {', '.join(KINDS)};"
                          f" got {text!r}")
    if kind in RANK_KINDS:
        return Injection.parse(text)
    return dataclasses.replace(Injection.parse(f"crash@{rest}"), kind=kind)


# Kinds that act on the idle replica's dummy step only.
DUMMY_ONLY = frozenset({"skip-dummy-forward", "skip-draft-sync", "draft-steps-mismatch", "stale-pcp-context",
                        "skip-buffer-refresh", "demote-graph-mode"})


class VLLMInjector:
    """Answers, at each decision point, whether `kind` is due on this replica now; remembers
    whether it fired and what the replica ran at the injection's step, to say why it did not."""

    def __init__(self, injection: Injection | None, dp_rank: int, *, on_fire: Callable[[], None] | None = None,
                 rank: int | None = None):
        """`on_fire()`: called once, when the injection first acts (the `injected` record replay
        reads); `rank`: this worker's rank within its replica (what `rank=K` names)."""
        self.injection, self.dp_rank, self.rank = injection, dp_rank, rank
        self.fired = False
        self.seen: str | None = None  # the kind of step (prefill, decode, idle) run at the injection's step
        self._on_fire = on_fire

    def due(self, kind: str, step_id: int) -> bool:
        """Asked only where `kind` would act now: True means it fires."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        i = self.injection
        hit = i is not None and i.kind == kind and i.replica == self.dp_rank and i.step == step_id \
            and i.rank in (None, self.rank)
        if hit and not self.fired and self._on_fire is not None:
            self._on_fire()
        self.fired = self.fired or hit
        return hit

    def saw(self, step_id: int, kind: str) -> None:
        """The replica began step `step_id` as a `kind` step."""
        i = self.injection
        if i is not None and i.replica == self.dp_rank and i.step == step_id:
            self.seen = kind

    def never_fired(self, last_step: int) -> str | None:
        """One line naming the fault and why it never applied, on the replica it targets; None
        when it fired, or targets another replica."""
        i = self.injection
        if i is None or i.replica != self.dp_rank or i.rank not in (None, self.rank) or self.fired:
            return None
        if self.seen is None:
            why = f"the run ended after step {last_step}, before step {i.step}"
        elif i.kind in DUMMY_ONLY and self.seen != "idle":
            why = (f"replica {i.replica} was not idle at step {i.step} (it ran a {self.seen} step);"
                   f" {i.kind} acts on a dummy step")
        elif i.kind in GRAPH_KINDS:
            why = f"replica {i.replica} ran step {i.step} ({self.seen}) without a graph replay, where {i.kind} acts"
        else:
            why = f"replica {i.replica} ran step {i.step} ({self.seen}) without reaching where {i.kind} acts"
        return f"inject {i} never fired: {why}"
