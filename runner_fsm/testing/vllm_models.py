"""Tiny random Hugging Face checkpoints, for the vLLM tests and benchmark.

Made with `transformers` (no network): a dense Llama, a Mixtral and a Qwen3-MoE, float32,
vocabulary 512, head size 32 (vLLM's CPU attention needs at least 32), with a word-level
tokenizer over the vocabulary so that the HTTP server can decode text. Same seed, same weights.
`ARCHITECTURES` are the three every FSMWorker test runs; `MLA_ARCHITECTURES` adds a DeepSeek-V2
(MLA and MoE), for the tests that need MLA only. `make_mtp_model` writes a DeepSeek-V3 (MLA) with
one multi-token-prediction layer, MoE or dense, for vLLM's `speculative_config={"method": "mtp"}`.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
ARCHITECTURES = ("llama", "mixtral", "qwen3_moe")
MLA_ARCHITECTURES = ("deepseek_v2",)
# MLA on vLLM's CPU caches one latent row of kv_lora_rank + qk_rope_head_dim = 576 per token
# (its only supported MLA head size) in blocks of 16; everything else is kept small. Layer 0
# is dense, layer 1 MoE. HF's DeepSeek-V2 router never normalises the top-k weights, vLLM's
# does when norm_topk_prob is set: False keeps the two comparable.
DEEPSEEK_V2 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                   q_lora_rank=None, num_attention_heads=4, num_key_value_heads=4,
                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   moe_intermediate_size=64, first_k_dense_replace=1, topk_method="greedy",
                   n_group=1, topk_group=1,  # vLLM always routes by groups: one group of all experts
                   norm_topk_prob=False, routed_scaling_factor=1.0)
MLA_BLOCK_SIZE = 16
# DeepSeek-V3 as vLLM loads it with its MTP layer: the router is "noaux_tc" with sigmoid scores
# and a correction bias (HF's DeepSeek-V3 router; without these two fields vLLM's loader stops on
# `e_score_correction_bias`). `MTP_DENSE_LAYERS` makes every layer dense, the MTP layer included
# (vLLM's default CPU worker can then run it under DP: no MoE exchange collectives needed).
DEEPSEEK_V3 = dict(DEEPSEEK_V2, topk_method="noaux_tc", scoring_func="sigmoid")
MTP_LAYERS = 2  # target layers; the MTP layer is layer MTP_LAYERS
MTP_DENSE_LAYERS = MTP_LAYERS + 1
# The tensors of vLLM's DeepSeek MTP layer beyond a decoder layer's (vllm/model_executor/models/
# deepseek_mtp.py: DeepSeekMultiTokenPredictorLayer, SharedHead, DeepSeekMultiTokenPredictor).
MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight", "embed_tokens.weight")


def _config(arch: str, **overrides):
    import transformers as tf

    common = {**COMMON, **overrides}
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "deepseek_v2":
        common.pop("head_dim")  # DeepSeek-V2 derives its head sizes from the MLA fields
        return tf.DeepseekV2Config(**{**common, **DEEPSEEK_V2, **overrides})
    if arch == "deepseek_v3":
        common.pop("head_dim")
        return tf.DeepseekV3Config(**{**common, **DEEPSEEK_V3, **overrides})
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES + MLA_ARCHITECTURES}")


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer: token i is the word `w<i>` (specials 0..2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))


def make_model(path: str | Path, arch: str, seed: int = 0, **overrides) -> str:
    """Write a random `arch` checkpoint (safetensors, float32) and tokenizer into `path`;
    `overrides`: config fields other than the tiny defaults (e.g. hidden_size)."""
    import torch
    import transformers as tf

    path = Path(path)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(arch, **overrides), torch_dtype=torch.float32)
    with torch.no_grad():  # larger weights than the init's: outputs that depend on the input
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    json.loads((path / "config.json").read_text())  # written whole
    return str(path)


def make_mtp_model(path: str | Path, *, moe: bool = True, seed: int = 0) -> str:
    """A DeepSeek-V3 with MTP_LAYERS layers and one MTP layer, from random weights.

    Saved as a model of MTP_LAYERS + 1 layers (the last is the MTP layer's decoder block), plus
    the MTP layer's own tensors (MTP_EXTRA) under `model.layers.{MTP_LAYERS}`; config.json then
    says MTP_LAYERS layers and `num_nextn_predict_layers: 1`. HF transformers loads the first
    MTP_LAYERS layers and ignores the rest: its greedy tokens are the reference (MTP drafts never
    change greedy tokens). `moe=False`: every layer dense (`first_k_dense_replace` past them all).
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    dense = {} if moe else {"first_k_dense_replace": MTP_DENSE_LAYERS}
    make_model(path, "deepseek_v3", seed=seed, num_hidden_layers=MTP_LAYERS + 1, **dense)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"expected one safetensors file in {path}, found {[f.name for f in files]}")
    tensors = load_file(str(files[0]))
    hidden = int(tensors["model.embed_tokens.weight"].shape[1])
    generator = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{MTP_LAYERS}."
    for name in MTP_EXTRA:
        if name.endswith("norm.weight"):
            tensor = torch.ones(hidden)
        elif name == "eh_proj.weight":
            tensor = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
        else:  # the MTP layer's own head and embedding, [vocab, hidden]
            tensor = torch.randn(VOCAB, hidden, generator=generator) * 0.2
        tensors[prefix + name] = tensor.contiguous()
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=MTP_LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)
