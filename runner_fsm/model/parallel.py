"""Devices and process groups of the reference model, and the few collectives it uses.

Tensor collectives (PCP K/V and hidden gathers, the expert exchange) run on the groups of the
device: the gloo groups themselves on the CPU, NCCL (CUDA) or HCCL (Ascend) groups created
beside them otherwise. Host-side headers always travel on the gloo groups. With one process
(no groups) every collective is skipped and the same code runs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from runner_fsm.errors import ConfigError

_TENSOR_BACKENDS = {"cuda": "nccl", "npu": "hccl"}


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device; `npu` imports `torch_npu` here, and only here."""
    name = str(device)
    if name.split(":")[0] == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device type)
        except ImportError as exc:
            raise ConfigError(f"device {name!r} needs torch_npu (Ascend CANN), which failed to import: {exc}") from None
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but torch sees no CUDA device")
    return dev


@dataclasses.dataclass(frozen=True)
class ModelGroups:
    """This rank's coordinates and groups; the roles are the same on every rank."""

    global_rank: int = 0
    world_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    pcp: dist.ProcessGroup | None = None  # tensor collectives inside this replica
    expert: dist.ProcessGroup | None = None  # tensor collectives over every rank
    control: dist.ProcessGroup | None = None  # gloo, every rank: host-side headers

    @property
    def dp_rank(self) -> int:
        return self.dp_rank_of(self.global_rank)

    def dp_rank_of(self, global_rank: int) -> int:
        """PCP ranks of one replica are contiguous global ranks (ParallelLayout)."""
        return global_rank // self.pcp_size

    @classmethod
    def from_process_groups(cls, groups, device: torch.device) -> "ModelGroups":
        """From `engine.groups.ProcessGroups`; collective over the world off the CPU."""
        layout = groups.layout
        pcp, expert = groups.pcp, groups.expert
        backend = _TENSOR_BACKENDS.get(device.type)
        if backend is not None:
            # new_group is collective over the world: every rank creates every group, in order.
            pcp_groups = [dist.new_group(r, backend=backend) for r in layout.pcp_group_ranks()]
            pcp = pcp_groups[groups.dp_rank]
            expert = dist.new_group(layout.expert_group_ranks(), backend=backend)
        return cls(
            global_rank=groups.global_rank, world_size=layout.world_size,
            pcp_rank=groups.pcp_rank, pcp_size=layout.pcp_size,
            pcp=pcp, expert=expert, control=groups.expert,
        )


def all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """[size * n, ...]: block r holds rank r's `tensor` (itself when there is no group)."""
    if group is None or size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    if group is not None and size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
