"""The runner's process groups, taken from the ones vLLM's worker start-up created.

With tensor and pipeline parallelism refused, vLLM's world is exactly the runner's DP x PCP
world, in the same order (global rank = dp_rank * pcp_size + pcp_rank), so vLLM's gloo CPU
groups are used as they are: its DP group carries the DP agreement, its PCP group the K/V and
hidden-state gathers, and the world group the expert exchange.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.launch import ProcessGroups
from runner_fsm.errors import ConfigError


def vllm_process_groups(layout: ParallelLayout, dp_rank: int) -> ProcessGroups | None:
    """The runner's groups from vLLM's, or None for a single process."""
    if layout.world_size == 1:
        return None
    from vllm.distributed import parallel_state as ps

    world = ps.get_world_group()
    pcp = ps.get_pcp_group()
    global_rank = layout.global_rank(dp_rank, pcp.rank_in_group)
    if world.world_size != layout.world_size or world.rank_in_group != global_rank:
        raise ConfigError(
            f"vLLM's world (rank {world.rank_in_group} of {world.world_size}) is not the runner's"
            f" DP x PCP world (rank {global_rank} of {layout.world_size}); only DP and PCP may split it")
    return ProcessGroups(layout=layout, global_rank=global_rank, dp_rank=dp_rank,
                         pcp_rank=pcp.rank_in_group, world=world.cpu_group,
                         dp=ps.get_dp_group().cpu_group, pcp=pcp.cpu_group, expert=world.cpu_group)


def shared_run_dir(chosen: str | None, groups: ProcessGroups | None, *, root: str = "runs") -> str:
    """The run directory every rank writes into: `chosen`, else one picked by global rank 0."""
    if chosen:
        return str(chosen)
    name = [str(Path(root) / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")]
    if groups is not None:
        dist.broadcast_object_list(name, src=0, group=groups.world)
    return name[0]
