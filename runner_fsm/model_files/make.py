"""Write a tiny random Mixtral checkpoint (config, weights, tokenizer) with no network.

Weights are scaled so that greedy decoding has wide argmax margins: every projection has std
1/sqrt(fan_in) (activations stay O(1) through the layers) and the LM head is larger, so the
float rounding that differs between DP/PCP layouts cannot flip a greedy token in practice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from runner_fsm.errors import ConfigError
from runner_fsm.model_files.hf_config import CONFIG_FILE, MixtralConfig
from runner_fsm.model_files.safetensors_io import save_file
from runner_fsm.model_files.tokenizer_files import write_tokenizer
from runner_fsm.model_files.shapes import expected_shapes

WEIGHTS_FILE = "model.safetensors"
LM_HEAD_GAIN = 4.0
MIN_VOCAB = 4


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of a random model; defaults fit vLLM's CPU backend (head size >= 32)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    experts: int = 4
    top_k: int = 2
    vocab: int = 512
    intermediate: int = 256
    rope_theta: float = 10000.0
    max_positions: int = 4096

    def to_config(self) -> MixtralConfig:
        return MixtralConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, num_local_experts=self.experts,
            num_experts_per_tok=self.top_k, head_dim=self.hidden // self.heads,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_positions,
        )


def with_overrides(spec: ModelSpec, **overrides: int | None) -> ModelSpec:
    """`spec` with every override that is not None."""
    return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})


TARGET_SPEC = ModelSpec()
DRAFT_SPEC = ModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)


def random_state_dict(cfg: MixtralConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for `cfg` from `seed` (same seed, same bytes)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(cfg).items():
        state[name] = _init(name, shape, cfg, gen)
    return state


def _init(name: str, shape: tuple[int, ...], cfg: MixtralConfig, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "model.embed_tokens.weight":
        std = 1.0
    elif name == "lm_head.weight":
        std = LM_HEAD_GAIN / math.sqrt(cfg.hidden_size)
    else:
        std = 1.0 / math.sqrt(shape[1])  # fan_in of an [out, in] projection
    return torch.randn(shape, generator=gen) * std


def make_random_model(model_dir: str | Path, spec: ModelSpec = TARGET_SPEC, *, seed: int = 0) -> MixtralConfig:
    """Write `config.json`, `model.safetensors` and the tokenizer files into `model_dir`."""
    if spec.vocab < MIN_VOCAB:
        raise ConfigError(f"make-model needs vocab >= {MIN_VOCAB} (three special tokens), got {spec.vocab}")
    if spec.hidden % spec.heads:
        raise ConfigError(f"make-model needs hidden ({spec.hidden}) divisible by heads ({spec.heads})")
    cfg = spec.to_config()
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=1) + "\n")
    save_file(random_state_dict(cfg, seed), model_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    write_tokenizer(model_dir, cfg.vocab_size, max_length=cfg.max_position_embeddings)
    return cfg
