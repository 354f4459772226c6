"""The paged KV cache as vLLM's KV-cache manager sees it, and its size.

vLLM's block ids index the runner's own `PagedKVCache`: the worker reports one
`FullAttentionSpec` per target layer (one KV cache group, so one block table per request),
vLLM decides `num_blocks`, and the worker then allocates caches of exactly that many blocks
for the target and, when drafting, for the replicated drafter (which reuses the target's block
ids). The drafter's cache is not visible to vLLM, so its bytes are taken out of the budget
before vLLM divides it into blocks.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from runner_fsm.model.hf_config import MixtralConfig
from runner_fsm.model.kv_cache import PagedKVCache


def layer_names(cfg: MixtralConfig) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)]


def kv_cache_spec(cfg: MixtralConfig, block_size: int, dtype: torch.dtype) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=int(block_size), num_kv_heads=cfg.num_key_value_heads,
                             head_size=cfg.head_dim, dtype=dtype)
    return {name: spec for name in layer_names(cfg)}


def bytes_per_token(cfg: MixtralConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def kv_budget_bytes(vllm_config: Any, target: MixtralConfig, draft: MixtralConfig | None,
                    dtype: torch.dtype, device: torch.device) -> int:
    """Bytes vLLM may divide into target KV blocks.

    `kv_cache_memory_bytes` when given (the target's and the drafter's caches together);
    otherwise room for `max_num_seqs` requests of `max_model_len` tokens (more cannot be used
    at once), capped by `gpu_memory_utilization` of the memory free now.
    """
    per_target = bytes_per_token(target, dtype)
    per_draft = bytes_per_token(draft, dtype) if draft is not None else 0
    share = per_target / (per_target + per_draft)
    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes is not None:
        return int(cache.kv_cache_memory_bytes * share)
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    block = int(cache.block_size)
    tokens_per_seq = -(-(int(model.max_model_len) + 1) // block) * block
    wanted = int(sched.max_num_seqs) * tokens_per_seq * (per_target + per_draft)
    cap = int(free_memory(device) * float(cache.gpu_memory_utilization))
    return int(min(wanted, cap) * share)


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def install_caches(model: Any, drafter: Any, num_blocks: int, block_size: int) -> None:
    """Give the target (and drafter) fresh caches of vLLM's `num_blocks` blocks."""
    model.decoder.cache = _sized_like(model.decoder.cache, model.cfg, num_blocks, block_size)
    if drafter is not None:
        cache = _sized_like(drafter.decoder.cache, drafter.decoder.cfg, num_blocks, block_size)
        drafter.decoder.cache = drafter.cache = cache


def _sized_like(old: PagedKVCache, cfg: MixtralConfig, num_blocks: int, block_size: int) -> PagedKVCache:
    return PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=int(num_blocks),
                        block_size=int(block_size), kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, dtype=old.k.dtype, device=old.k.device)


def copy_blocks(caches: list[PagedKVCache], copies: Any) -> None:
    """vLLM's copy-on-write block copies (`KVCacheBlockCopy(src, dst)`), in every cache."""
    for cache in caches:
        bs = cache.block_size
        for src, dst in copies:
            cache.k[:, dst * bs:(dst + 1) * bs] = cache.k[:, src * bs:(src + 1) * bs]
            cache.v[:, dst * bs:(dst + 1) * bs] = cache.v[:, src * bs:(src + 1) * bs]
