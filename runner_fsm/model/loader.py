"""What the engine calls: build a rank's target model or drafter from a model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from runner_fsm.errors import ConfigError
from runner_fsm.model.decoder import MixtralDecoder
from runner_fsm.model.drafter import MixtralDrafter
from runner_fsm.model.kv_cache import PagedKVCache
from runner_fsm.model.model import MixtralModel
from runner_fsm.model.parallel import ModelGroups, resolve_device
from runner_fsm.model_files.checkpoint import LazyCheckpoint
from runner_fsm.model_files.hf_config import MixtralConfig
from runner_fsm.model_files.weights import bind_weights

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
           "bfloat16": torch.bfloat16}


def model_groups(groups, device: str | torch.device = "cpu") -> ModelGroups:
    """`ModelGroups` from `engine.groups.ProcessGroups` (None: one process).

    Off the CPU this creates the device's tensor groups, a collective over the world: build
    it once per process and pass it to both `load_model` and `load_drafter`.
    """
    if groups is None:
        return ModelGroups()
    if isinstance(groups, ModelGroups):
        return groups
    return ModelGroups.from_process_groups(groups, resolve_device(device))


def load_model(model_dir: str | Path, *, kv_num_blocks: int, block_size: int, groups=None,
               device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32) -> MixtralModel:
    """The target model of this rank: PCP-parallel attention, expert-parallel MoE."""
    decoder = _load_decoder(model_dir, kv_num_blocks, block_size, groups, device, dtype, pcp=True)
    return MixtralModel(decoder)


def load_drafter(draft_dir: str | Path, *, kv_num_blocks: int, block_size: int, groups=None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
                 target_vocab_size: int | None = None) -> MixtralDrafter:
    """The replicated draft of this rank; its KV cache uses the target's block ids."""
    decoder = _load_decoder(draft_dir, kv_num_blocks, block_size, groups, device, dtype, pcp=False)
    vocab = decoder.cfg.vocab_size
    if target_vocab_size is not None and vocab != target_vocab_size:
        raise ConfigError(f"{draft_dir}: the draft's vocab_size={vocab} differs from the target's"
                          f" {target_vocab_size}; greedy verification compares token ids")
    return MixtralDrafter(decoder)


def _load_decoder(model_dir, kv_num_blocks, block_size, groups, device, dtype, *, pcp: bool) -> MixtralDecoder:
    dev = resolve_device(device)
    cfg = MixtralConfig.from_dir(model_dir)
    torch_dtype = _dtype(dtype, cfg)
    mg = model_groups(groups, dev)
    weights = bind_weights(cfg, LazyCheckpoint(model_dir), rank=mg.global_rank, world_size=mg.world_size,
                           device=dev, dtype=torch_dtype, source=str(model_dir))
    cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=kv_num_blocks, block_size=block_size,
                         kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch_dtype, device=dev)
    return MixtralDecoder(cfg, weights, cache, mg, gather_kv_over_pcp=pcp)


def _dtype(dtype: str | torch.dtype, cfg: MixtralConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[name]
