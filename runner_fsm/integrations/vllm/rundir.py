"""Where every rank of a vLLM job writes its logs, and which global rank it is there."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from runner_fsm.integrations.vllm.errors import UnsupportedFeatureError


def replica_coords(vllm_config: Any, rank_in_replica: int) -> tuple[int, int, int]:
    """(dp_rank, pcp_rank, global_rank) in the audit log's DP x PCP layout.

    The log names ranks by replica and PCP rank only, so tensor and pipeline parallelism,
    which would put several ranks at one coordinate, are refused here, by name."""
    par = vllm_config.parallel_config
    split = [f"{name}={getattr(par, name)}" for name in ("tensor_parallel_size", "pipeline_parallel_size",
                                                           "decode_context_parallel_size")
             if int(getattr(par, name, 1) or 1) > 1]
    if split:
        raise UnsupportedFeatureError("FSMWorker records replicas split by PCP only; it does not support "
                                      + ", ".join(split))
    pcp_size = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    dp_rank = int(par.data_parallel_rank)
    pcp_rank = int(rank_in_replica) % pcp_size
    return dp_rank, pcp_rank, dp_rank * pcp_size + pcp_rank


def shared_run_dir(chosen: str | None, dp_size: int, *, root: str = "runs") -> str:
    """`chosen`, else a fresh `runs/vllm-<time>-<pid>` picked by DP rank 0 and broadcast over
    vLLM's DP CPU group (once, at start-up, before any step)."""
    if chosen:
        return str(chosen)
    name = [str(Path(root) / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")]
    if dp_size > 1:
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_dp_group

        group = get_dp_group()
        dist.broadcast_object_list(name, src=group.ranks[0], group=group.cpu_group)
    return name[0]
