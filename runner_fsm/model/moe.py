"""Top-k routed SwiGLU experts, expert-parallel over every rank (DP x PCP).

Per layer: route this rank's rows, exchange headers and check them, all-gather the padded rows
and their routing, apply the experts this rank owns to every gathered row routed to them, and
one all_reduce(SUM) gives every rank its rows back. No capacity limit and no dropping: a
token's output depends on its own row only. A token's output is the sum of its top-k experts'
weighted outputs, accumulated in ascending expert order; with top-2 that sum is exact under
any order (two non-zero terms plus zeros), so outputs do not depend on the DP/PCP layout.
"""

from __future__ import annotations

import torch

from runner_fsm.model.dispatch import DispatchHeader, ExchangeStep, check_headers, exchange_headers
from runner_fsm.model.layers import compute_dtype, swiglu
from runner_fsm.model.parallel import ModelGroups, all_gather_rows, all_reduce_sum
from runner_fsm.model.weights import ExpertWeights

NO_EXPERT = -1  # the expert id of padding rows: no expert takes them


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [n, k] and weights [n, k]: softmax over the top-k router logits."""
    logits = x @ router.T
    logits = logits.to(compute_dtype(logits.dtype))
    top_logits, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top_logits, dim=-1)


def local_experts_eager(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        experts: dict[int, ExpertWeights]) -> torch.Tensor:
    """Each owned expert runs on exactly the rows routed to it."""
    out = torch.zeros_like(x)
    for e in sorted(experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        ew = experts[e]
        y = swiglu(x[rows], ew.w1, ew.w3, ew.w2) * weights[rows, slots, None].to(x.dtype)
        out.index_add_(0, rows, y)
    return out


def local_experts_dense(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        experts: dict[int, ExpertWeights]) -> torch.Tensor:
    """Static shapes (graph path): each owned expert runs on every row, unrouted rows add 0."""
    out = torch.zeros_like(x)
    for e in sorted(experts):
        hit = ids == e
        weight = (weights * hit).sum(-1).to(x.dtype)  # at most one slot holds e
        ew = experts[e]
        y = swiglu(x, ew.w1, ew.w3, ew.w2) * weight[:, None]
        out = out + torch.where(hit.any(-1)[:, None], y, torch.zeros_like(y))
    return out


def moe_layer(x: torch.Tensor, router: torch.Tensor, experts: dict[int, ExpertWeights], top_k: int,
              *, layer: int, step: ExchangeStep, groups: ModelGroups) -> torch.Tensor:
    """Expert output for this rank's rows x [n, H] (already normed)."""
    n = x.shape[0]
    ids, weights = route(x, router, top_k)
    header = DispatchHeader(step.step_id, step.phase, layer, step.dispatch_count, n)
    check_headers(exchange_headers(header, groups), step, groups)
    apply = local_experts_dense if step.use_graph else local_experts_eager
    world = groups.world_size
    if world == 1:
        return apply(x, ids, weights, experts)
    width = step.width
    gathered = all_gather_rows(_pack(x, ids, weights, width), groups.expert, world)
    gx, gids, gweights = _unpack(gathered, x.shape[1], top_k, x.dtype)
    partial = apply(gx, gids, gweights, experts)
    total = all_reduce_sum(partial, groups.expert, world)
    first = groups.global_rank * width
    return total[first:first + n]


def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, width: int) -> torch.Tensor:
    """One row per token, padded to `width`: hidden, routing weights, expert ids.

    In `compute_dtype` (float32 or float64), which holds every bf16/fp16 value and every
    expert id below 2**24 exactly, so one collective carries all three without loss.
    """
    n, hidden = x.shape
    k = ids.shape[1]
    dt = compute_dtype(x.dtype)
    payload = torch.zeros(width, hidden + 2 * k, dtype=dt, device=x.device)
    payload[:, hidden + k:] = NO_EXPERT
    payload[:n, :hidden] = x.to(dt)
    payload[:n, hidden:hidden + k] = weights.to(dt)
    payload[:n, hidden + k:] = ids.to(dt)
    return payload


def _unpack(payload: torch.Tensor, hidden: int, k: int, dtype: torch.dtype):
    x = payload[:, :hidden].to(dtype)
    weights = payload[:, hidden:hidden + k]
    ids = payload[:, hidden + k:].round().to(torch.int64)
    return x, ids, weights
