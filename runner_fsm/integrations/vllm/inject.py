"""Faults for the vLLM worker: `KIND@replica=R,step=S`, the worker option `inject`
(`additional_config={"runner_fsm": {"inject": ...}}`, else `RUNNER_FSM_INJECT`).

Each kind reproduces a DP hand-off bug seen in vLLM and vLLM-Ascend; the online checks must
stop every rank naming R and S, and `runner-fsm replay` must name them too. The PCP kinds act
in MRV2's PCP manager (`pcp_evidence`) and have no online check: replay names them from the
PCP evidence. Step ids count
the worker's steps from 0. The syntax is the embedded engine's (`runner_fsm.faults`); the
kinds differ, since they act on vLLM's own calls.
"""

from __future__ import annotations

import dataclasses

from runner_fsm.errors import ConfigError
from runner_fsm.faults import Injection

KINDS = (
    "skip-dummy-forward",  # the idle replica agrees, then returns without its dummy forward
    "skip-draft-sync",  # the idle replica skips the drafter's dummy run (vLLM issue #35294)
    "desync",  # the replica reports the next step id in its agreement rows
    # MRV2's PCP manager (`pcp_evidence`), the hand-off bugs vLLM-Ascend's "Adapt PCP for DP" fixed:
    "stale-pcp-context",  # the idle replica's dummy reads the last real batch's PCP slot mappings
    "skip-buffer-refresh",  # the dummy runs over the PCP input buffers the last real batch left
    "wrong-dispatch-count",  # the global token count sent where the PCP-local one is due
)


def parse(text: str) -> Injection:
    # The embedded parser knows the embedded kinds only: parse the shared syntax with a
    # known kind in its place, then check ours.
    kind, sep, rest = text.strip().partition("@")
    if kind not in KINDS or not sep:
        raise ConfigError(f"inject expects KIND@replica=R,step=S with KIND one of {', '.join(KINDS)};"
                          f" got {text!r}")
    return dataclasses.replace(Injection.parse(f"crash@{rest}"), kind=kind)


class VLLMInjector:
    """Answers, at each decision point, whether `kind` is due on this replica now."""

    def __init__(self, injection: Injection | None, dp_rank: int):
        self.injection, self.dp_rank = injection, dp_rank

    def due(self, kind: str, step_id: int) -> bool:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        i = self.injection
        return i is not None and i.kind == kind and i.replica == self.dp_rank and i.step == step_id
