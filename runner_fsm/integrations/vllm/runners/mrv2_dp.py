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

from runner_fsm import dp

MRV2_ROWS = ("num_tokens", "cg_mode", "uniform_token_count", "max_query_len", "allow_ubatching", "num_reqs")


def graph_decision(manager, dp_rank: int) -> Callable[[list[list[int]]], dict]:
    """vLLM's own graph decision from the summed rows, as `sync_cudagraph_and_dp_padding` makes
    it (vLLM 0.32, no microbatching: the CPU and the emulation run without DBO): every replica's
    requested mode where one asked for a graph (`requested_graph_modes`, vLLM's `CUDAGraphMode`
    values); eager for all when one asks eager ("if any rank wants to run eager, all ranks run
    eager"), else the descriptor
    `manager().dispatch` gives for the largest count, every replica padded to its size. Logged as
    the agreement's `graph_mode` and `num_tokens_across_dp` (the project's rule, which knows no
    capture sizes, would say eager and unpadded)."""
    def decide(rows: list[list[int]]) -> dict:
        tokens, modes, uniform, max_query = rows[0], rows[1], rows[2], rows[3]
        # Every replica's request, where one asked for a graph (else eager says it all, and the
        # record keeps its compact form)
        out = {"requested_graph_modes": modes} if max(modes) else {}
        graphs = manager()
        if not any(tokens) or min(modes) == 0 or graphs is None:
            return {**out, "graph_mode": dp.GRAPH_EAGER}
        synced_uniform = uniform[0] if uniform[0] and all(u == uniform[0] for u in uniform) else None
        synced_max_query = max(max_query) if all(m != -1 for m in max_query) else None
        desc = graphs.dispatch(rows[5][dp_rank], max(tokens), synced_uniform, num_active_loras=0,
                               max_query_len=synced_max_query)
        full = desc.cg_mode.value == dp.GRAPH_FULL
        return {**out, "graph_mode": dp.GRAPH_FULL if full else dp.GRAPH_EAGER,
                "num_tokens_across_dp": [int(desc.num_tokens)] * len(tokens) if full else tokens}
    return decide


class _CarryingDist:
    """`torch.distributed` as MRV2's dp_utils sees it, with the agreement in its all_reduce."""

    def __init__(self, tap, decide=None, eager_vote=None):  # `dp.agreement.AgreementTap`, `graph_decision`
        self._tap = tap
        self._decide = decide
        self._eager_vote = eager_vote  # () -> True: this replica asks for eager (demote-graph-mode)

    def all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dim() != 2 or tensor.shape[0] != len(MRV2_ROWS) or op != torch.distributed.ReduceOp.SUM \
                or async_op:
            return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)
        if self._eager_vote is not None and self._eager_vote():
            tensor[1, self._tap.dp_rank] = 0  # vLLM's cg_mode row: CUDAGraphMode.NONE, "run eager"
        summed = self._tap.exchange(tensor, group, device=tensor.device, num_tokens_row=0, graph_row=1,
                                    decide=self._decide)
        tensor.copy_(summed)
        return None

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


def install(tap, decide=None, eager_vote=None) -> Callable[[], None]:
    """Route MRV2's DP sync collective through `tap` (`decide`: `graph_decision`; `eager_vote()`:
    whether this replica asks for eager in this sync, an injected fault); returns the undo."""
    from vllm.v1.worker.gpu import dp_utils

    if dp_utils.dist is not torch.distributed:
        raise RuntimeError(f"vllm.v1.worker.gpu.dp_utils.dist is {dp_utils.dist!r}, not torch.distributed:"
                           " another interception is installed")
    dp_utils.dist = _CarryingDist(tap, decide, eager_vote)

    def undo() -> None:
        dp_utils.dist = torch.distributed
    return undo
