"""What a replica logs so that replay can recompute a step instead of trusting it (DESIGN §7),
and the one online exchange that evidence needs: the PCP ranks' output digests.

The rules that judge this evidence live in `runner_fsm.rules.checks`, shared with replay.
"""

from __future__ import annotations

import dataclasses

from runner_fsm import dp


def identity(step: int, dummy: bool, rows: int, digest: int) -> dict:
    """What a batch or a PCP attention context is: the step it was built for, real or dummy,
    its rows per PCP rank and the digest of its layout arrays (`pcp.context.layout_digest`);
    `rules.context_rule.context_problem` compares two of them."""
    return {"step": int(step), "dummy": bool(dummy), "rows": int(rows), "digest": int(digest)}


def context_identity(ctx) -> dict:
    """The identity a PCP attention context carries: what it was built for, by its own record
    (`built_for_step`) and its own arrays (`digest`), never by what the caller meant it for."""
    return identity(-1 if ctx.built_for_step is None else ctx.built_for_step, ctx.is_dummy,
                    ctx.num_tokens_padded, ctx.digest)


def gather_output_digests(group, step_id: int, digest: int) -> list[tuple[int, int]]:
    """[(step_id, digest)] of every PCP rank of the replica, by one all_gather on its PCP group."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([step_id, digest], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [(int(p[0]), int(p[1])) for p in parts]


def corrupted(agreed: dp.DPSyncState, dp_rank: int) -> dp.DPSyncState:
    """Fault injection `corrupt-agreement`: this replica's copy of the agreement, its own count
    off by one after the all-reduce (vLLM-Ascend #10046: dirty CPU all-reduce data)."""
    counts = list(agreed.num_tokens_across_dp)
    counts[dp_rank] += 1
    return dataclasses.replace(agreed, num_tokens_across_dp=tuple(counts))


def diverged(sampled: dict[str, list[int]]) -> dict[str, list[int]]:
    """Fault injection `pcp-divergence`: the first sampled token one off, as after a 1-ULP
    difference in the logits on one PCP rank."""
    out = dict(sampled)
    first = next(iter(out), None)
    if first is not None and out[first]:
        token = out[first][0]
        out[first] = [token - 1 if token > 0 else token + 1, *out[first][1:]]
    return out
