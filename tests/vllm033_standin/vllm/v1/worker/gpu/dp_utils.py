"""Stand-in for vllm/v1/worker/gpu/dp_utils.py (0.33.0): `sync_cudagraph_and_dp_padding`'s
collective and the rows it reads back, lines 66-88; the graph decision after them (89-210) is
left out: the stand-in's descriptor is always eager, as on a platform without graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed.parallel_state import get_dp_group


@dataclass
class DPSyncState:  # dp_utils.py:31-42, the fields the tests read
    num_tokens_across_dp: torch.Tensor
    num_reqs: int
    skip_drafts: bool = False


def should_skip_dp_coordination() -> bool:  # vllm/v1/worker/dp_utils.py; False outside its test modes
    return False


def sync_cudagraph_and_dp_padding(cudagraph_manager, desired_batch_desc, num_tokens: int, num_reqs: int,
                                  uniform_token_count: int | None, dp_size: int, dp_rank: int,
                                  max_query_len: int | None = None, num_active_loras: int = 0,
                                  parallel_config=None, allow_ubatching: bool = False,
                                  uniform_decode: bool = False, allow_skip_drafts: bool = False):
    assert dp_size > 1, "DP size must be greater than 1"
    tensor = torch.zeros(7, dp_size, dtype=torch.int32, device="cpu")
    tensor[0][dp_rank] = num_tokens
    tensor[1][dp_rank] = desired_batch_desc.cg_mode.value
    tensor[2][dp_rank] = uniform_token_count or 0  # (0 means None)
    tensor[3][dp_rank] = max_query_len or -1  # (-1 means None)
    tensor[4][dp_rank] = int(allow_ubatching)
    tensor[5][dp_rank] = num_reqs
    tensor[6][dp_rank] = int(allow_skip_drafts)
    if should_skip_dp_coordination():
        tensor[:] = tensor[:, dp_rank, None].clone()
    else:
        get_dp_group().cpu_all_reduce_(tensor)

    num_tokens_across_dp = tensor[0]
    num_reqs_across_dp = tensor[5]
    allow_skip_drafts_across_dp = tensor[6]
    skip_drafts = bool(torch.all(allow_skip_drafts_across_dp == 1))
    if torch.all(num_tokens_across_dp == 0).item():
        return desired_batch_desc, None
    return desired_batch_desc, DPSyncState(num_tokens_across_dp.clone(), int(num_reqs_across_dp.max()),
                                           skip_drafts=skip_drafts)
