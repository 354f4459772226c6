"""Top-k routed SwiGLU experts, expert-parallel over every rank (DP x PCP).

Per layer: route this rank's rows, then exchange them with the ranks that own their experts.
Eager steps take the routed exchange (`exchange.py`): the checked header carries the counts,
two all_to_all_single calls move only routed rows there and their results back. Graph steps
(uniform decode under FULL_DECODE_ONLY) keep static shapes: all-gather the padded rows and
their routing, apply the owned experts to every row routed to them, one all_reduce(SUM); the
header check runs once per forward outside the captured region (`graphs.host_step`). In both,
padding rows route nowhere and a PCP-replicated row is computed once, by PCP rank 0.
No capacity limit and no dropping: a token's output depends on its own row only. A token's
output is the sum of its top-k experts' weighted outputs; with top-2 that sum is exact under
any order (two non-zero terms plus zeros), so outputs do not depend on the DP/PCP layout.
"""

from __future__ import annotations

import dataclasses

import torch

from runner_fsm.model.dispatch import DispatchHeader, ExchangeStep, check_headers, exchange_headers
from runner_fsm.model.exchange import NO_EXPERT, RowRoles, gathered_bytes, routed_exchange
from runner_fsm.model.layers import compute_dtype, swiglu
from runner_fsm.model.parallel import ModelGroups, all_gather_rows, all_reduce_sum
from runner_fsm.model_files.weights import ExpertWeights

ROUTED, GATHERED = "routed", "gathered"  # the two exchanges of an eager step


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


@dataclasses.dataclass
class Traffic:
    """Bytes this rank sent in its expert exchanges since the last reset, and what the
    all-gather exchange would have sent for the same rows (computed, not run)."""

    exchange: str = ROUTED
    sent_bytes: int = 0
    gathered_bytes: int = 0
    layers: int = 0

    def reset(self, exchange: str, per_layer: int = 0, layers: int = 0) -> None:
        """Start a forward's count; a graph forward's is known up front: `layers` x `per_layer`."""
        self.exchange, self.layers = exchange, layers
        self.sent_bytes = self.gathered_bytes = per_layer * layers

    def as_record(self) -> dict:
        """The forward's `done` record's field: [exchange, bytes sent, bytes an all-gather would
        have sent, MoE layers] (one list: it is written every forward)."""
        return {"exchange": [self.exchange, self.sent_bytes, self.gathered_bytes, self.layers]}


def moe_layer(x: torch.Tensor, router: torch.Tensor, experts: dict[int, ExpertWeights], top_k: int,
              *, layer: int, step: ExchangeStep, groups: ModelGroups, roles: RowRoles,
              traffic: Traffic, exchange: str = ROUTED) -> torch.Tensor:
    """Expert output for this rank's rows x [n, H] (already normed)."""
    n = x.shape[0]
    ids, weights = route(x, router, top_k)
    if step.use_graph:  # header check and traffic: once per forward, outside the graph (decoder)
        return _gathered(x, ids, weights, experts, step, groups, roles)
    step = dataclasses.replace(step, top_k=top_k)
    world = groups.world_size
    width = step.width
    traffic.layers += 1
    static_bytes = gathered_bytes(width, x.shape[1], top_k, world, compute_dtype(x.dtype).itemsize,
                                  x.element_size())
    traffic.gathered_bytes += static_bytes
    if exchange == ROUTED and world > 1:
        def counts(plan):
            header = DispatchHeader(step.step_id, step.phase, layer, step.dispatch_count, n, plan.counts, plan.fanout)
            headers = exchange_headers(header, groups)
            check_headers(headers, step, groups)
            return [h.sends for h in headers], [h.fanout for h in headers]

        def apply(rx, rids, rweights):
            return local_experts_eager(rx, rids, rweights, experts)

        out, sent = routed_exchange(x, ids, weights, roles, groups, counts, apply)
        traffic.sent_bytes += sent
        return out
    check_headers(exchange_headers(DispatchHeader(step.step_id, step.phase, layer, step.dispatch_count, n),
                                   groups), step, groups)
    traffic.sent_bytes += static_bytes
    return _gathered(x, ids, weights, experts, step, groups, roles)


def _gathered(x, ids, weights, experts, step: ExchangeStep, groups: ModelGroups, roles: RowRoles):
    """Static shapes: every rank's padded rows to every rank, one all_reduce of the results."""
    n = x.shape[0]
    apply = local_experts_dense if step.use_graph else local_experts_eager
    # Eager (the baseline exchange): every real row, replicated ones on every PCP rank.
    routed = roles.sent_here(groups.pcp_rank) if step.use_graph else ~roles.padding
    ids = torch.where(routed[:, None], ids, torch.full_like(ids, NO_EXPERT))
    world = groups.world_size
    if world == 1:
        return apply(x, ids, weights, experts)
    width = step.width
    gathered = all_gather_rows(_pack(x, ids, weights, width), groups.expert, world)
    gx, gids, gweights = _unpack(gathered, x.shape[1], ids.shape[1], x.dtype)
    total = all_reduce_sum(apply(gx, gids, gweights, experts), groups.expert, world)
    first = groups.global_rank * width
    own = total[first:first + n]
    if groups.pcp_rank == 0 or not step.use_graph:
        return own
    # A replicated row was sent by PCP rank 0 only; replicated rows sit at the same index on
    # every PCP rank when every real row is replicated: a uniform decode, the only graph step.
    lead = (groups.global_rank - groups.pcp_rank) * width
    return torch.where(roles.replicated[:, None], total[lead:lead + n], own)


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
