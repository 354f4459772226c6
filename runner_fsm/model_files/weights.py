"""Mixtral parameters under their Hugging Face names, checked and bound to layers.

Experts are parallel over every rank: a rank keeps only the experts it owns
(`expert % world_size == rank`), so a checkpoint's expert tensors are dropped on load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import torch

from runner_fsm.errors import WeightsError
from runner_fsm.model_files.hf_config import MixtralConfig
from runner_fsm.model_files.safetensors_io import load_file
from runner_fsm.model_files.shapes import check_state_dict


@dataclasses.dataclass
class ExpertWeights:
    w1: torch.Tensor  # gate [I, H]
    w3: torch.Tensor  # up [I, H]
    w2: torch.Tensor  # down [H, I]


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor  # [E, H]
    experts: dict[int, ExpertWeights]  # only the experts this rank owns


@dataclasses.dataclass
class MixtralWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every `*.safetensors` shard in `model_dir`, read whole (tests and
    references; a rank loads through `checkpoint.LazyCheckpoint`)."""
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            if name in tensors:
                raise WeightsError(f"{model_dir}: tensor {name} appears in more than one shard")
            tensors[name] = tensor
    return tensors


def bind_weights(cfg: MixtralConfig, state: Mapping[str, torch.Tensor], *, rank: int,
                 world_size: int, device: torch.device, dtype: torch.dtype,
                 source: str = "state dict") -> MixtralWeights:
    """Check `state` against `cfg` and keep what rank `rank` of `world_size` needs.

    Each tensor is read from `state` once, when it is bound, and only if this rank keeps it;
    `.to` returns the read tensor itself when device and dtype already match (no second copy).
    """
    check_state_dict(cfg, state, source)

    def get(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype).contiguous()

    layers = [_bind_layer(cfg, get, layer, rank, world_size) for layer in range(cfg.num_hidden_layers)]
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return MixtralWeights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)


def _bind_layer(cfg: MixtralConfig, get, layer: int, rank: int, world_size: int) -> LayerWeights:
    p = f"model.layers.{layer}."
    experts = {
        e: ExpertWeights(
            w1=get(f"{p}block_sparse_moe.experts.{e}.w1.weight"),
            w3=get(f"{p}block_sparse_moe.experts.{e}.w3.weight"),
            w2=get(f"{p}block_sparse_moe.experts.{e}.w2.weight"),
        )
        for e in owned_experts(cfg.num_local_experts, rank, world_size)
    }
    return LayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        q_proj=get(p + "self_attn.q_proj.weight"),
        k_proj=get(p + "self_attn.k_proj.weight"),
        v_proj=get(p + "self_attn.v_proj.weight"),
        o_proj=get(p + "self_attn.o_proj.weight"),
        post_norm=get(p + "post_attention_layernorm.weight"),
        router=get(p + "block_sparse_moe.gate.weight"),
        experts=experts,
    )


def owned_experts(num_experts: int, rank: int, world_size: int) -> list[int]:
    """Expert `e` lives on rank `e % world_size`, so any expert count fits any world."""
    return [e for e in range(num_experts) if e % world_size == rank]
