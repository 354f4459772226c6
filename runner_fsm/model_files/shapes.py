"""A Mixtral checkpoint's tensor names and shapes, as its config.json implies them, and the check
of a state dict (or a shard's headers) against them.

Without torch: `runner-fsm run` checks a model directory in its launcher before any rank starts,
and only the ranks load torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from runner_fsm.errors import WeightsError
from runner_fsm.model_files.hf_config import MixtralConfig


def expected_shapes(cfg: MixtralConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the checkpoint and its shape."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "block_sparse_moe.gate.weight": (cfg.num_local_experts, h),
        })
        for e in range(cfg.num_local_experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({x + "w1.weight": (i, h), x + "w2.weight": (h, i), x + "w3.weight": (i, h)})
    return shapes


def _shape(state: Mapping[str, Any], name: str) -> tuple[int, ...]:
    """From the header when `state` is lazy (`LazyCheckpoint.shape_of`): checking reads no data."""
    shape_of = getattr(state, "shape_of", None)
    return tuple(shape_of(name)) if shape_of is not None else tuple(state[name].shape)


def check_state_dict(cfg: MixtralConfig, state: Mapping[str, Any], source: str) -> None:
    shapes = expected_shapes(cfg)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes) - ignorable)
    if missing or unexpected:
        raise WeightsError(f"{source}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''},"
                           f" unexpected tensors {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, shape in shapes.items():
        if _shape(state, name) != shape:
            raise WeightsError(f"{source}: {name} has shape {list(_shape(state, name))}, config.json"
                               f" implies {list(shape)}")
