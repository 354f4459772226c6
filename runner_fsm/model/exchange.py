"""The routed expert exchange: a row travels only to the ranks that own its selected experts.

Per layer of an eager step: every rank counts, per destination rank, the rows it will send;
the counts ride in the checked header (one small gloo all_gather, `dispatch.py`), so every rank
knows every split before a hidden row moves and all of them size the same two
`all_to_all_single` calls from the same numbers. The first carries rows to their experts'
owners, the second carries the weighted expert outputs back.

- padding rows go nowhere;
- a row replicated on every PCP rank of a replica (a decode row, every draft row) is sent once,
  by PCP rank 0, tagged with its index among the replicated rows; the expert owner returns its
  result to every PCP rank of that replica, which places it by that index (the replicated
  rows are the same tokens in the same order on every PCP rank of a replica).

A row whose two experts live on one rank is sent there once, carrying both expert ids.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from runner_fsm.model.layers import compute_dtype
from runner_fsm.model.parallel import ModelGroups

NO_EXPERT = -1  # the expert id of a row slot that no expert on the receiving rank takes


@dataclasses.dataclass(frozen=True, eq=False)
class RowRoles:
    """Per row of this rank: padding (no token) and PCP-replicated (a copy on every PCP rank)."""

    padding: torch.Tensor  # [n] bool
    replicated: torch.Tensor  # [n] bool

    @classmethod
    def uniform(cls, n: int, device, *, padding: bool = False, replicated: bool = False) -> "RowRoles":
        return cls(torch.full((n,), padding, dtype=torch.bool, device=device),
                   torch.full((n,), replicated, dtype=torch.bool, device=device))

    def sent_here(self, pcp_rank: int) -> torch.Tensor:
        """Rows whose experts this rank asks for: real, and a replicated row only on PCP rank 0."""
        real = ~self.padding
        return real if pcp_rank == 0 else real & ~self.replicated

    def replica_index(self) -> torch.Tensor:
        """[n] int64: the index of each replicated row among them, -1 elsewhere."""
        rep = self.replicated & ~self.padding
        index = torch.cumsum(rep.to(torch.int64), 0) - 1
        return torch.where(rep, index, torch.full_like(index, -1))


@dataclasses.dataclass(frozen=True, eq=False)
class SendPlan:
    """What this rank sends in one layer: one entry per (row, destination rank), destination-major."""

    rows: torch.Tensor  # [m] local row of each entry
    dest: torch.Tensor  # [m] destination global rank
    counts: tuple[int, ...]  # [world] entries per destination
    fanout: tuple[int, ...]  # [world] entries per destination that carry a replicated row


def plan_sends(ids: torch.Tensor, roles: RowRoles, world: int, pcp_rank: int) -> SendPlan:
    n = ids.shape[0]
    hit = torch.zeros(n, world, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, ids % world, True)  # expert e lives on rank e % world
    hit &= roles.sent_here(pcp_rank)[:, None]
    dest, rows = hit.T.nonzero(as_tuple=True)
    tagged = roles.replica_index()[rows] >= 0
    counts = torch.bincount(dest, minlength=world)
    fanout = torch.bincount(dest[tagged], minlength=world)
    return SendPlan(rows, dest, tuple(counts.tolist()), tuple(fanout.tolist()))


def pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, roles: RowRoles, plan: SendPlan,
         world: int) -> torch.Tensor:
    """[m, H + 2k + 1] in `compute_dtype`: hidden, weights, the ids the destination owns, tag.

    `compute_dtype` (float32 or float64) holds every bf16/fp16 value and every id below 2**24
    exactly, so one collective carries all of it without loss.
    """
    dt = compute_dtype(x.dtype)
    rows = plan.rows
    mine = (ids[rows] % world) == plan.dest[:, None]
    sent_ids = torch.where(mine, ids[rows], torch.full_like(ids[rows], NO_EXPERT))
    tag = roles.replica_index()[rows]
    return torch.cat([x[rows].to(dt), weights[rows].to(dt), sent_ids.to(dt), tag[:, None].to(dt)], dim=1)


def unpack(payload: torch.Tensor, hidden: int, k: int, dtype: torch.dtype):
    x = payload[:, :hidden].to(dtype)
    weights = payload[:, hidden:hidden + k]
    ids = payload[:, hidden + k:hidden + 2 * k].round().to(torch.int64)
    tag = payload[:, hidden + 2 * k].round().to(torch.int64)
    return x, ids, weights, tag


@dataclasses.dataclass(frozen=True)
class Splits:
    """Every split of one layer's two all_to_alls on this rank, from the exchanged headers."""

    dispatch_send: list[int]  # rows to each rank
    dispatch_recv: list[int]  # rows from each rank
    combine_send: list[int]  # results to each rank: its own rows, then its replica's tagged rows
    combine_recv: list[int]  # results from each rank, in the same layout

    @classmethod
    def of(cls, counts: list[tuple[int, ...]], fanout: list[tuple[int, ...]], me: int,
           pcp_size: int) -> "Splits":
        world = len(counts)

        def leader(rank: int) -> int:
            return rank - rank % pcp_size

        def back(src: int, via: int) -> int:
            """Results `via` returns to `src`: src's own rows, plus its leader's tagged rows."""
            extra = fanout[leader(src)][via] if src != leader(src) else 0
            return counts[src][via] + extra

        return cls(
            dispatch_send=[counts[me][t] for t in range(world)],
            dispatch_recv=[counts[s][me] for s in range(world)],
            combine_send=[back(t, me) for t in range(world)],
            combine_recv=[back(me, e) for e in range(world)],
        )


def all_to_all(payload: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = payload.new_empty((sum(recv), payload.shape[1]))
    if group is None:  # one rank: the exchange is the identity
        out.copy_(payload)
        return out
    dist.all_to_all_single(out, payload.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    return out


def combine_order(tags: torch.Tensor, splits: Splits, me: int, pcp_size: int) -> torch.Tensor:
    """Indices into the received rows that lay out the results to return (`combine_send`)."""
    starts = [0]
    for count in splits.dispatch_recv:
        starts.append(starts[-1] + count)
    parts = []
    for t in range(len(splits.dispatch_recv)):
        parts.append(torch.arange(starts[t], starts[t + 1], device=tags.device))
        lead = t - t % pcp_size
        if lead != t:  # a non-leader PCP rank also gets its leader's replicated rows
            own = torch.arange(starts[lead], starts[lead + 1], device=tags.device)
            parts.append(own[tags[starts[lead]:starts[lead + 1]] >= 0])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=tags.device)


def scatter_results(returned: torch.Tensor, plan: SendPlan, roles: RowRoles, splits: Splits,
                    n: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, H]: each row's returned expert outputs summed (at most top_k terms, plus zeros)."""
    out = torch.zeros(n, hidden, dtype=dtype, device=returned.device)
    own, tagged = [], []
    start = 0
    for e, count in enumerate(splits.combine_recv):
        mine = splits.dispatch_send[e]
        own.append(returned[start:start + mine])
        tagged.append(returned[start + mine:start + count])
        start += count
    own_rows = torch.cat(own)
    out.index_add_(0, plan.rows, own_rows[:, :hidden].to(dtype))
    fan = torch.cat(tagged)
    if fan.shape[0]:
        replicated = roles.replicated & ~roles.padding
        where = replicated.nonzero(as_tuple=True)[0]
        out.index_add_(0, where[fan[:, hidden].round().to(torch.int64)], fan[:, :hidden].to(dtype))
    return out


def header_bytes(world: int, *, with_counts: bool) -> int:
    """Bytes of one rank's header to its peers: 5 int64 fields, plus 2 per rank when routed."""
    return (5 + (2 * world if with_counts else 0)) * 8 * (world - 1)


def traffic_bytes(splits: Splits, me: int, dispatch_width: int, combine_width: int, itemsize: int) -> int:
    """Bytes this rank sends to other ranks in one layer: its header and the two all_to_alls."""
    rows_out = sum(c for t, c in enumerate(splits.dispatch_send) if t != me)
    back_out = sum(c for t, c in enumerate(splits.combine_send) if t != me)
    world = len(splits.dispatch_send)
    return (rows_out * dispatch_width + back_out * combine_width) * itemsize + header_bytes(world, with_counts=True)


def gathered_bytes(width: int, hidden: int, k: int, world: int, payload_itemsize: int, itemsize: int) -> int:
    """Bytes one rank sends in the all-gather exchange: its header, its padded rows to every
    peer, then its share of a ring all_reduce of the [world * width, H] result (2 (w-1)/w)."""
    gather = (world - 1) * width * (hidden + 2 * k) * payload_itemsize
    reduce = 2 * (world - 1) * width * hidden * itemsize
    return gather + reduce + header_bytes(world, with_counts=False)


def routed_exchange(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, roles: RowRoles,
                    groups: ModelGroups, exchange_counts, apply_experts) -> tuple[torch.Tensor, int]:
    """Expert outputs [n, H] for this rank's rows and the bytes this rank sent.

    `exchange_counts(plan)` exchanges and checks the headers and returns every rank's
    (counts, fanout); `apply_experts(x, ids, weights)` runs this rank's experts.
    """
    n, hidden = x.shape
    k = ids.shape[1]
    world, me = groups.world_size, groups.global_rank
    plan = plan_sends(ids, roles, world, groups.pcp_rank)
    counts, fanout = exchange_counts(plan)
    splits = Splits.of(counts, fanout, me, groups.pcp_size)
    payload = pack(x, ids, weights, roles, plan, world)
    received = all_to_all(payload, splits.dispatch_send, splits.dispatch_recv, groups.expert)
    rx, rids, rweights, tags = unpack(received, hidden, k, x.dtype)
    partial = apply_experts(rx, rids, rweights).to(payload.dtype)
    results = torch.cat([partial, tags[:, None].to(payload.dtype)], dim=1)[
        combine_order(tags, splits, me, groups.pcp_size)]
    returned = all_to_all(results, splits.combine_send, splits.combine_recv, groups.expert)
    out = scatter_results(returned, plan, roles, splits, n, hidden, x.dtype)
    sent = traffic_bytes(splits, me, payload.shape[1], results.shape[1], payload.element_size())
    return out, sent
