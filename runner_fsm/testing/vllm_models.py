"""Tiny random Hugging Face checkpoints of three architectures, for the vLLM tests and benchmark.

Made with `transformers` (no network): a dense Llama, a Mixtral and a Qwen3-MoE, float32,
vocabulary 512, head size 32 (vLLM's CPU attention needs at least 32), with a word-level
tokenizer over the vocabulary so that the HTTP server can decode text. Same seed, same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
ARCHITECTURES = ("llama", "mixtral", "qwen3_moe")


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
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES}")


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
