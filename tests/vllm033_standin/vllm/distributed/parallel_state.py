"""Stand-in for vllm/distributed/parallel_state.py (0.33.0): the DP group's coordinator.

`GroupCoordinator.cpu_all_reduce_` (parallel_state.py:1381-1383) calls `cpu_all_reduce_` of
vllm/distributed/utils.py:62-120: an in-place SUM of a small CPU tensor over the gloo
`cpu_group` by send/recv (recursive doubling; two ranks here: one exchange), not a gloo
all_reduce. A peer in `torch.distributed.all_reduce` on the same group would never meet it.
"""

from __future__ import annotations

import torch

_CPU_ALL_REDUCE_TAG_BASE = 27100  # vllm/distributed/utils.py:59


class GroupCoordinator:
    def __init__(self, cpu_group):
        self.cpu_group = cpu_group
        self.calls = 0  # how many reductions vLLM's own collective made (the test reads it)

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        group = self.cpu_group
        world_size = group.size()
        assert world_size == 2, "the stand-in does the two-rank case of utils.py:89-103 only"
        peer = group.rank() ^ 1
        scratch = torch.empty_like(tensor)
        recv_work = group.recv([scratch], peer, _CPU_ALL_REDUCE_TAG_BASE)
        send_work = group.send([tensor], peer, _CPU_ALL_REDUCE_TAG_BASE)
        recv_work.wait()
        send_work.wait()
        tensor.add_(scratch)
        return tensor


_DP: GroupCoordinator | None = None


def get_dp_group() -> GroupCoordinator:
    assert _DP is not None, "data parallel group is not initialized"
    return _DP
