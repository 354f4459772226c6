"""The DP agreement inside Model Runner V2's DP sync (`vllm.v1.worker.gpu.dp_utils`).

MRV2's `sync_cudagraph_and_dp_padding` builds an int32 `[6, dp]` tensor (`num_tokens, cg_mode,
uniform_count, max_query_len, allow_ubatching, num_reqs`) and calls `dist.all_reduce` on it
inline: there is no `_run_ar` to replace and no public hook. The module reaches the collective
through its global `dist`, so `install` puts a proxy there whose `all_reduce` carries the
agreement rows of an `AgreementTap` below vLLM's six in the same collective, checks them, and
writes vLLM's summed rows back into vLLM's tensor in place; every other attribute is
`torch.distributed`'s. vLLM's function itself runs unchanged (MRV2 needs Triton with a CPU
backend to run a model on the CPU, so this is exercised at the function level in tests).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed

MRV2_ROWS = ("num_tokens", "cg_mode", "uniform_token_count", "max_query_len", "allow_ubatching", "num_reqs")


class _CarryingDist:
    """`torch.distributed` as MRV2's dp_utils sees it, with the agreement in its all_reduce."""

    def __init__(self, tap):  # `dp.agreement.AgreementTap`
        self._tap = tap

    def all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dim() != 2 or tensor.shape[0] != len(MRV2_ROWS) or op != torch.distributed.ReduceOp.SUM \
                or async_op:
            return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)
        summed = self._tap.exchange(tensor, group, device=tensor.device, num_tokens_row=0, graph_row=1)
        tensor.copy_(summed)
        return None

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


def install(tap) -> Callable[[], None]:
    """Route MRV2's DP sync collective through `tap`; returns the undo."""
    from vllm.v1.worker.gpu import dp_utils

    if dp_utils.dist is not torch.distributed:
        raise RuntimeError(f"vllm.v1.worker.gpu.dp_utils.dist is {dp_utils.dist!r}, not torch.distributed:"
                           " another interception is installed")
    dp_utils.dist = _CarryingDist(tap)

    def undo() -> None:
        dp_utils.dist = torch.distributed
    return undo
