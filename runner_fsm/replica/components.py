"""The small interfaces a replica's steps are built from.

The real implementations are the Part 1 code (planner, buffers, DP agreement) and the
reference MoE model; tests put in-process fakes behind the same interfaces.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from runner_fsm.batch import ScheduledBatch
from runner_fsm.dp import DPSyncState, LocalDispatch
from runner_fsm.pcp.buffers import PersistentBuffers
from runner_fsm.pcp.context import PCPAttentionContext


@dataclasses.dataclass(frozen=True)
class ForwardStep:
    """One target forward of one rank; identical on the PCP ranks of a replica."""

    step_id: int
    num_rows: int  # rows this rank executes, padded as agreed
    agreed: DPSyncState
    dispatch_count: int  # the count this replica must have reported (0 for a dummy)
    is_dummy: bool = False


class Agreement(Protocol):
    """The one DP collective of a phase (`runner_fsm.dp.sync` on the DP gloo group)."""

    def sync(self, local: LocalDispatch) -> DPSyncState: ...


class Model(Protocol):
    """The target model of one PCP rank."""

    def forward(self, buffers: PersistentBuffers, step: ForwardStep) -> torch.Tensor:
        """`step.num_rows` rank-local output rows, reading the step's inputs from `buffers` only.

        The expert exchange is sized from `step.agreed`; a replica whose real count differs
        from what it reported (`dispatch_count`) must make every rank fail loudly."""

    def restore(self, local: torch.Tensor, ctx: PCPAttentionContext) -> torch.Tensor:
        """Gather the PCP ranks' rows and reorder them to global token order."""

    def sample(self, restored: torch.Tensor) -> np.ndarray:
        """Greedy token of every row (global order); `runner_fsm.replica.spec` picks what to keep."""


class Drafter(Protocol):
    """The replicated draft model: it runs the global batch on every PCP rank.

    After the target has verified this step, the draft processes each request's newly
    known tokens (DRAFT_PREFILL, one forward) and proposes its first draft token; each
    DRAFT_DECODE forward (K - 1 of them, one row per request) proposes one more.
    An idle replica runs the same forwards on a dummy of the agreed size.
    """

    def prefill_rows(self, batch: ScheduledBatch, sampled: dict[str, list[int]]) -> int:
        """Rows of this step's draft prefill: the global count sent to the agreement."""

    def prefill(self, batch: ScheduledBatch | None, sampled: dict[str, list[int]] | None,
                step: ForwardStep) -> None:
        """Draft forward over the newly known tokens (a dummy when `batch` is None)."""

    def decode(self, step: ForwardStep) -> None:
        """One draft decode forward: one row per request (a dummy when idle)."""

    def proposals(self) -> dict[str, list[int]]:
        """The K draft tokens per request proposed in this step."""
