"""Tiny random Hugging Face checkpoints, for the vLLM tests and benchmark.

Made with `transformers` (no network): a dense Llama, a Mixtral and a Qwen3-MoE, float32,
vocabulary 512, head size 32 (vLLM's CPU attention needs at least 32), with a word-level
tokenizer over the vocabulary so that the HTTP server can decode text. Same seed, same weights.
`ARCHITECTURES` are the three every FSMWorker test runs; `MLA_ARCHITECTURES` adds a DeepSeek-V2
(MLA and MoE), for the tests that need MLA only.
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
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES + MLA_ARCHITECTURES}")


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer: token i is the word `w<i>` (specials 0..2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
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
