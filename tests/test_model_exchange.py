"""The routed expert exchange (`model/exchange.py`) over DP=2 x PCP=2 on gloo.

Every rank builds the same random experts and its own rows (with padding, and replicated rows
that sit at different indices on the two PCP ranks of a replica, as in a mixed batch). The
exchange's outputs must equal a dense reference of every expert on every real row; padding
rows get nothing; a replicated row is sent by PCP rank 0 only and still reaches both ranks;
and the bytes sent are below what the all-gather exchange would send.
"""

from __future__ import annotations

import pytest
import torch

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.launch import spawn
from runner_fsm.model.exchange import RowRoles, Splits, routed_exchange
from runner_fsm.model.layers import swiglu
from runner_fsm.model.moe import local_experts_eager
from runner_fsm.model.parallel import ModelGroups
from runner_fsm.model_files.weights import ExpertWeights

HIDDEN, INTER, EXPERTS, TOP_K = 16, 24, 8, 2

# Per PCP rank of each replica: row kinds. "r<q>": replicated row q of the replica,
# "o": a row of this rank only, "p": padding.
LAYOUTS = {
    (0, 0): ["r0", "o", "r1", "o", "p"],
    (0, 1): ["o", "r0", "r1", "p", "p"],
    (1, 0): ["o", "o", "o", "p", "p"],
    (1, 1): ["o", "p", "p", "p", "p"],
}


def _experts() -> dict[int, ExpertWeights]:
    gen = torch.Generator().manual_seed(7)

    def w(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[1] ** 0.5

    return {e: ExpertWeights(w(INTER, HIDDEN), w(INTER, HIDDEN), w(HIDDEN, INTER)) for e in range(EXPERTS)}


def _rows(dp_rank: int, pcp_rank: int):
    """Rows, routing and roles of one rank; a replicated row's values come from (replica, q)."""
    kinds = LAYOUTS[(dp_rank, pcp_rank)]
    xs, ids, ws = [], [], []
    for i, kind in enumerate(kinds):
        seed = 1000 * dp_rank + int(kind[1:]) if kind.startswith("r") else 100 + 10 * (2 * dp_rank + pcp_rank) + i
        gen = torch.Generator().manual_seed(seed)
        xs.append(torch.randn(HIDDEN, generator=gen, dtype=torch.float64))
        ids.append(torch.randperm(EXPERTS, generator=gen)[:TOP_K])
        ws.append(torch.softmax(torch.randn(TOP_K, generator=gen, dtype=torch.float64), 0))
    roles = RowRoles(torch.tensor([k == "p" for k in kinds]), torch.tensor([k.startswith("r") for k in kinds]))
    return torch.stack(xs), torch.stack(ids), torch.stack(ws), roles


def _reference(x, ids, ws, roles, experts):
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        if not roles.padding[i]:
            for slot in range(TOP_K):
                ew = experts[int(ids[i, slot])]
                out[i] += ws[i, slot] * swiglu(x[i:i + 1], ew.w1, ew.w3, ew.w2)[0]
    return out


def _job(groups):
    import torch.distributed as dist

    mg = ModelGroups.from_process_groups(groups, torch.device("cpu"))
    experts = _experts()
    mine = {e: w for e, w in experts.items() if e % mg.world_size == mg.global_rank}
    x, ids, ws, roles = _rows(groups.dp_rank, groups.pcp_rank)
    seen = {}

    def counts(plan):
        seen["counts"], seen["fanout"] = plan.counts, plan.fanout
        local = torch.tensor([*plan.counts, *plan.fanout], dtype=torch.int64)
        parts = [torch.empty_like(local) for _ in range(mg.world_size)]
        dist.all_gather(parts, local, group=mg.control)
        half = mg.world_size
        return [tuple(p[:half].tolist()) for p in parts], [tuple(p[half:].tolist()) for p in parts]

    out, sent = routed_exchange(x, ids, ws, roles, mg, counts, lambda a, b, c: local_experts_eager(a, b, c, mine))
    ref = _reference(x, ids, ws, roles, experts)
    return {"max_diff": float((out - ref).abs().max()), "sent": sent, "counts": seen["counts"],
            "fanout": seen["fanout"], "padding_zero": bool((out[roles.padding] == 0).all())}


@pytest.mark.multiproc
def test_routed_exchange_dp2_pcp2_matches_dense_reference():
    results = spawn(_job, ParallelLayout(2, 2), timeout_s=120)
    for rank, res in enumerate(results):
        assert res["max_diff"] < 1e-12, f"rank {rank}: routed output differs from the reference by {res['max_diff']}"
        assert res["padding_zero"], f"rank {rank}: a padding row got an expert output"
    # Entries sent: one per (row, distinct owner rank) of the rows each rank sends.
    # Rank 1 (PCP rank 1 of replica 0) sends only its 1 own row, never its 2 replicated copies.
    sent_rows = [sum(r["counts"]) for r in results]
    assert sent_rows[1] <= 2 and sent_rows[1] >= 1, sent_rows
    assert sum(results[1]["fanout"]) == 0 and sum(results[0]["fanout"]) >= 2, [r["fanout"] for r in results]
    assert sum(results[3]["counts"]) <= 2, "rank 3 has one real row: at most top_k entries"
    _check_bytes_sent(results)


# Bytes, written out from the wire format (model/exchange.py) for this case: H=16, k=2, float64,
# world 4. A dispatched entry is [hidden, weights, ids, tag] = 21 values, a returned result
# [hidden, tag] = 17; the routed header is 5 + 2 * 4 int64 fields to each of 3 peers.
ENTRY, RESULT, ROUTED_HEADER = 21 * 8, 17 * 8, 13 * 8 * 3
# The all-gather exchange: each rank's 5 padded rows of [hidden, weights, ids] = 20 values to
# each of 3 peers, then its share of a ring all_reduce of the [4 * 5, 16] result (2 * 3 * 5 * 16
# values), and a header of 5 int64 fields to each peer.
ALL_GATHER = 3 * 5 * 20 * 8 + 2 * 3 * 5 * 16 * 8 + 5 * 8 * 3


def _check_bytes_sent(results):
    for me, res in enumerate(results):
        dispatched = sum(c for dest, c in enumerate(res["counts"]) if dest != me)
        received = sum(r["counts"][me] for peer, r in enumerate(results) if peer != me)
        # every entry received from a peer goes back to it (a replicated row's to each PCP rank)
        assert res["sent"] >= dispatched * ENTRY + received * RESULT + ROUTED_HEADER, (me, res)
        assert res["sent"] < ALL_GATHER, f"rank {me} sent {res['sent']} bytes, the all-gather exchange {ALL_GATHER}"
    # rank 3 has one real row: at most 2 entries out, and what comes back for others' rows
    assert results[3]["sent"] <= 2 * ENTRY + sum(r["counts"][3] for r in results[:3]) * RESULT \
        + sum(r["fanout"][3] for r in results[:3]) * RESULT + ROUTED_HEADER


def test_splits_return_replicated_results_to_every_pcp_rank():
    # World of 4, PCP=2: rank 0 sends 3 rows to rank 2, two of them replicated (tagged).
    counts = [(0, 0, 3, 0), (0, 0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 0)]
    fanout = [(0, 0, 2, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0)]
    on_2 = Splits.of(counts, fanout, me=2, pcp_size=2)
    assert on_2.dispatch_recv == [3, 1, 0, 0]
    assert on_2.combine_send == [3, 1 + 2, 0, 0]  # rank 1 gets its own row and rank 0's two tagged
    on_1 = Splits.of(counts, fanout, me=1, pcp_size=2)
    assert on_1.combine_recv == [0, 0, 3, 0] and on_1.dispatch_send == [0, 0, 1, 0]


@pytest.mark.parametrize("pcp_rank, expected", [(0, [True, True, True, False]), (1, [True, False, True, False])])
def test_row_roles_send_replicated_rows_from_pcp_rank_0_only(pcp_rank, expected):
    roles = RowRoles(torch.tensor([False, False, False, True]), torch.tensor([False, True, False, False]))
    assert roles.sent_here(pcp_rank).tolist() == expected
    assert roles.replica_index().tolist() == [-1, 0, -1, -1]


@pytest.mark.parametrize("rank, expected", [(0, [True, False, False, False, False, False, False]),
                                            (1, [True, False, False, False, False, False, False])])
def test_buffers_mark_the_decode_row_replicated_on_every_pcp_rank(rank, expected):
    # DESIGN's worked example: request 0 decodes (replicated), request 1 is a fresh 10-token
    # prefill split over 2 PCP ranks; N = 7, so rank 0 has 2 padding rows.
    import numpy as np

    from runner_fsm.config import ParallelLayout, RunnerConfig
    from runner_fsm.pcp.buffers import PersistentBuffers
    from runner_fsm.pcp.context import build_real_context
    from runner_fsm.pcp.plan import plan_batch

    tables = np.array([[5, 6, 7], [2, 3, -1]])
    config = RunnerConfig(layout=ParallelLayout(1, 2), max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8)
    buffers = PersistentBuffers(config)
    buffers.write_dummy(1, 7)
    buffers.is_replicated.fill_(True)  # a stale value must not survive the write
    plan = plan_batch([1, 10], [False, True], [37, 0], 2)
    ctx = build_real_context(plan, rank, tables, 16)
    buffers.write_real(plan, rank, np.arange(100, 111), tables, ctx.gathered_slot_mapping)
    assert buffers.is_replicated[:7].tolist() == expected
    assert not bool(buffers.is_replicated[7:].any())
