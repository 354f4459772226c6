"""A rank's gloo process groups: the world, its DP and PCP groups, the expert group.

Made once per rank, by `engine.launch.spawn`'s children (`init_process_groups`, rank 0's store
on `host`) or in a process `torchrun` started (`init_process_groups_from_env`). `new_group` is
collective over the whole world, so every rank creates every group in the same order.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch.distributed as dist

from runner_fsm.config import ParallelLayout
from runner_fsm.engine.rendezvous import LOOPBACK, is_loopback, rendezvous_store
from runner_fsm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ProcessGroups:
    """One process's groups and coordinates; every member of a group holds the same group."""

    layout: ParallelLayout
    global_rank: int
    dp_rank: int
    pcp_rank: int
    world: dist.ProcessGroup  # every rank
    dp: dist.ProcessGroup  # the replicas' ranks holding this PCP rank: the DP agreement's group
    pcp: dist.ProcessGroup  # this replica's PCP ranks
    expert: dist.ProcessGroup  # every rank: experts are parallel over DP x PCP


def init_process_groups(
    layout: ParallelLayout, global_rank: int, port: int, *, timeout_s: float = 60.0, host: str = LOOPBACK
) -> ProcessGroups:
    """Join the gloo job whose store is at `host`:`port` and create every DP, PCP and expert group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(host, port, global_rank == 0, layout.world_size, timeout)
    dist.init_process_group("gloo", store=store, rank=global_rank, world_size=layout.world_size,
                            timeout=timeout)
    return _create_groups(layout, global_rank, timeout)


def init_process_groups_from_env(layout: ParallelLayout, *, timeout_s: float = 60.0) -> ProcessGroups:
    """Join a job started by `torchrun`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != layout.world_size:
        raise ConfigError(f"torchrun started WORLD_SIZE={world_size} processes, the layout"
                          f" dp={layout.dp_size} x pcp={layout.pcp_size} needs {layout.world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = int(os.environ["RANK"])
    host = os.environ["MASTER_ADDR"]
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # read when the gloo group is made
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # torchrun's agent hosts the store (it binds it, not us): join it as env:// does.
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    else:
        store = rendezvous_store(host, int(os.environ["MASTER_PORT"]), rank == 0, world_size, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    return _create_groups(layout, rank, timeout)


def _create_groups(layout: ParallelLayout, global_rank: int, timeout) -> ProcessGroups:
    # `new_group` is collective over the whole world, so every rank creates every group in
    # the same order and keeps the ones it belongs to.
    dp_rank, pcp_rank = layout.coords(global_rank)
    dp_groups = [dist.new_group(ranks, timeout=timeout) for ranks in layout.dp_group_ranks()]
    pcp_groups = [dist.new_group(ranks, timeout=timeout) for ranks in layout.pcp_group_ranks()]
    expert = dist.new_group(layout.expert_group_ranks(), timeout=timeout)
    return ProcessGroups(
        layout=layout,
        global_rank=global_rank,
        dp_rank=dp_rank,
        pcp_rank=pcp_rank,
        world=dist.group.WORLD,
        dp=dp_groups[pcp_rank],
        pcp=pcp_groups[dp_rank],
        expert=expert,
    )
