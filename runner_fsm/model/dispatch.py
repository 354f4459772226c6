"""The header every rank sends before an expert exchange, and its check against the agreement.

Headers travel first, on their own small gloo collective, so a rank whose count disagrees is
caught before any hidden row is sized, sent or used: every rank receives the same headers
and therefore raises the same error naming the culprit, instead of mis-routing tokens or
hanging in a mis-sized all_gather.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from runner_fsm import dp
from runner_fsm.errors import DesyncError, DispatchCountError
from runner_fsm.model.parallel import ModelGroups


@dataclasses.dataclass(frozen=True)
class DispatchHeader:
    """What one rank says about the exchange it is joining."""

    step_id: int
    phase: int
    layer: int
    dispatch_count: int  # the count its replica must have sent to the DP agreement
    rows: int  # the rows it actually executes
    sends: tuple[int, ...] = ()  # routed exchange: entries it sends to each rank
    fanout: tuple[int, ...] = ()  # of those, entries carrying a PCP-replicated row

    def as_tuple(self) -> tuple[int, ...]:
        return (self.step_id, self.phase, self.layer, self.dispatch_count, self.rows, *self.sends, *self.fanout)

    @classmethod
    def from_values(cls, values: list[int]) -> "DispatchHeader":
        head, rest = values[:5], values[5:]
        half = len(rest) // 2
        return cls(*head, tuple(rest[:half]), tuple(rest[half:]))


@dataclasses.dataclass(frozen=True)
class ExchangeStep:
    """The agreed facts of one forward's expert exchanges; identical on every rank."""

    step_id: int
    phase: int
    num_tokens_across_dp: tuple[int, ...]
    use_graph: bool
    dispatch_count: int  # this rank's (the one value that differs across replicas)
    rows: int  # this rank's
    top_k: int = 2  # experts per token: bounds the routed counts a header may claim

    @property
    def width(self) -> int:
        """M: rows every rank pads to; a dummy runs 1 row where the agreement says 0."""
        return max(max(self.num_tokens_across_dp), 1)

    @classmethod
    def from_forward(cls, step, rows: int) -> "ExchangeStep":
        agreed = step.agreed
        return cls(step.step_id, agreed.phase, tuple(agreed.num_tokens_across_dp), agreed.use_graph,
                   step.dispatch_count, rows)


def exchange_headers(local: DispatchHeader, groups: ModelGroups) -> list[DispatchHeader]:
    if groups.control is None or groups.world_size == 1:
        return [local]
    mine = torch.tensor(local.as_tuple(), dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(groups.world_size)]
    dist.all_gather(parts, mine, group=groups.control)
    return [DispatchHeader.from_values(part.tolist()) for part in parts]


def check_headers(headers: list[DispatchHeader], step: ExchangeStep, groups: ModelGroups) -> None:
    """Raise the same error on every rank when any header disagrees with the agreement."""
    _check_in_step(headers)
    for rank, header in enumerate(headers):
        problem = _problem(header, step, groups.dp_rank_of(rank))
        if problem:
            replica = groups.dp_rank_of(rank)
            raise DispatchCountError(
                f"expert exchange, step {header.step_id} ({dp.phase_name(header.phase)}), layer"
                f" {header.layer}: replica {replica} (global rank {rank}) {problem}; every rank"
                f" stops before using a row",
                replica=replica, global_rank=rank, step_id=header.step_id,
                reported=header.dispatch_count, agreed=step.num_tokens_across_dp[replica],
                rows=header.rows, width=step.width,
            )


def _problem(header: DispatchHeader, step: ExchangeStep, replica: int) -> str:
    agreed = step.num_tokens_across_dp[replica]
    said = f"dispatches {header.dispatch_count} tokens per PCP rank and executes {header.rows} rows"
    if not step.use_graph and header.dispatch_count != agreed:
        return (f"sent {agreed} tokens to the DP agreement, but its batch dispatches"
                f" {header.dispatch_count} tokens per PCP rank (the agreement must carry the"
                f" PCP-local count)")
    if header.rows > step.width:
        return f"{said}, more than the exchange width {step.width} (max of the agreed {list(step.num_tokens_across_dp)})"
    if header.rows < header.dispatch_count:
        return f"{said}: fewer rows than tokens, so some tokens would never reach their experts"
    if header.sends and (min(header.sends) < 0 or sum(header.sends) > header.rows * step.top_k
                         or any(f > s for f, s in zip(header.fanout, header.sends))):
        return (f"{said} but routes {list(header.sends)} rows to the ranks ({list(header.fanout)}"
                f" replicated): more than {step.top_k} per row, negative, or more replicated than sent")
    return ""


def _check_in_step(headers: list[DispatchHeader]) -> None:
    where = {(h.step_id, h.phase, h.layer) for h in headers}
    if len(where) == 1:
        return
    each = ", ".join(f"rank {r} at step {h.step_id} {dp.phase_name(h.phase)} layer {h.layer}"
                     for r, h in enumerate(headers))
    raise DesyncError(f"expert exchange joined by ranks at different points: {each}")
