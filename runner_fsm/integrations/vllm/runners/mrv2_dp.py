"""The DP agreement inside Model Runner V2's DP sync (`vllm.v1.worker.gpu.dp_utils`).

MRV2's `sync_cudagraph_and_dp_padding` builds an int32 tensor, one column per DP rank, and
all-reduces it inline: there is no `_run_ar` to replace and no public hook. The rows and the
collective depend on the release (`SYNCS`):

- vLLM 0.32: `[6, dp]` (`num_tokens, cg_mode, uniform_count, max_query_len, allow_ubatching,
  num_reqs`), `dist.all_reduce(tensor, group=group)` through the module's global `dist`;
- vLLM 0.33: `[7, dp]` (a seventh row, `allow_skip_drafts`), `get_dp_group().cpu_all_reduce_(tensor)`
  through its global `get_dp_group`: vLLM's own send/recv SUM over the DP group's gloo group
  (vllm/v1/worker/gpu/dp_utils.py:68-79 and vllm/distributed/utils.py:62 in 0.33.0).

`install` puts a proxy in that global whose collective carries the agreement rows of an
`AgreementTap` below vLLM's rows in the same collective (on 0.33, vLLM's own `cpu_all_reduce_`
makes it, and the tap's abort path joins it the same way), checks them, and writes vLLM's
summed rows back into vLLM's tensor in place; everything else is the real object's. vLLM's
function itself runs unchanged (MRV2 needs Triton with a CPU backend to run a model on the CPU,
so this is exercised at the function level in tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed

from runner_fsm import dp
from runner_fsm.integrations.vllm.common import versions

MRV2_ROWS = ("num_tokens", "cg_mode", "uniform_token_count", "max_query_len", "allow_ubatching", "num_reqs")


@dataclasses.dataclass(frozen=True)
class SyncShape:
    """How one release's `sync_cudagraph_and_dp_padding` makes its collective."""

    rows: tuple[str, ...]  # its tensor's rows, in order
    global_name: str  # the module global it reaches the collective through


SYNCS = {
    "0.32.0": SyncShape(MRV2_ROWS, "dist"),
    "0.33.0": SyncShape((*MRV2_ROWS, "allow_skip_drafts"), "get_dp_group"),
}


def sync_shape(version: str | None = None) -> SyncShape:
    if version is None:
        from runner_fsm.integrations.vllm.common.schema import installed_version

        version = installed_version()
    return versions.pick(SYNCS, version)


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


class _Carrier:
    """The agreement carried in vLLM's DP sync tensor of `rows` rows (`carry`)."""

    def __init__(self, tap, rows: int, decide=None, eager_vote=None):  # `AgreementTap`, `graph_decision`
        self._tap = tap
        self._rows = rows
        self._decide = decide
        self._eager_vote = eager_vote  # () -> True: this replica asks for eager (demote-graph-mode)

    def ours(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() == 2 and tensor.shape[0] == self._rows

    def carry(self, tensor: torch.Tensor, group) -> None:
        if self._eager_vote is not None and self._eager_vote():
            tensor[1, self._tap.dp_rank] = 0  # vLLM's cg_mode row: CUDAGraphMode.NONE, "run eager"
        summed = self._tap.exchange(tensor, group, device=tensor.device, num_tokens_row=0, graph_row=1,
                                    decide=self._decide)
        tensor.copy_(summed)


class _CarryingDist:
    """vLLM 0.32: `torch.distributed` as MRV2's dp_utils sees it, with the agreement in its all_reduce."""

    def __init__(self, carrier: _Carrier):
        self._carrier = carrier

    def all_reduce(self, tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if not self._carrier.ours(tensor) or op != torch.distributed.ReduceOp.SUM or async_op:
            return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)
        self._carrier.carry(tensor, group)
        return None

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _CarryingGroup:
    """vLLM 0.33: the DP `GroupCoordinator` as MRV2's dp_utils sees it, with the agreement in its
    `cpu_all_reduce_`; the tap's own collective is that same `cpu_all_reduce_` (`install`)."""

    def __init__(self, coordinator, carrier: _Carrier):
        self._coordinator = coordinator
        self._carrier = carrier

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._carrier.ours(tensor):
            return self._coordinator.cpu_all_reduce_(tensor)
        self._carrier.carry(tensor, self._coordinator.cpu_group)
        return tensor

    def __getattr__(self, name):
        return getattr(self._coordinator, name)


def install(tap, decide=None, eager_vote=None, *, version: str | None = None) -> Callable[[], None]:
    """Route MRV2's DP sync collective through `tap` (`decide`: `graph_decision`; `eager_vote()`:
    whether this replica asks for eager in this sync, an injected fault); returns the undo."""
    from vllm.v1.worker.gpu import dp_utils

    shape = sync_shape(version)
    carrier = _Carrier(tap, len(shape.rows), decide, eager_vote)
    original = getattr(dp_utils, shape.global_name)
    if shape.global_name == "dist":
        if original is not torch.distributed:
            raise RuntimeError(f"vllm.v1.worker.gpu.dp_utils.dist is {original!r}, not torch.distributed:"
                               " another interception is installed")
        dp_utils.dist = _CarryingDist(carrier)
    else:
        if getattr(original, "_runner_fsm_carrier", False):
            raise RuntimeError(f"vllm.v1.worker.gpu.dp_utils.get_dp_group is {original!r}: another"
                               " interception is installed")
        def get_dp_group():
            return _CarryingGroup(original(), carrier)
        get_dp_group._runner_fsm_carrier = True
        # The agreement's own collective (its abort path too) is vLLM's, as every peer runs it
        tap.all_reduce = lambda tensor, group: original().cpu_all_reduce_(tensor)
        dp_utils.get_dp_group = get_dp_group

    def undo() -> None:
        setattr(dp_utils, shape.global_name, original)
        tap.all_reduce = None
    return undo
