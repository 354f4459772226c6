"""A minimal word-level tokenizer in Hugging Face's file format, written without `tokenizers`.

The vocabulary has exactly `vocab_size` entries (three specials, then made-up syllable words),
so every id the model can emit decodes. `tokenizer.json` is the `tokenizers` serialisation;
`tokenizer_config.json` and `generation_config.json` are what `transformers` and vLLM read.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unk, bos, eos
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def vocabulary(vocab_size: int) -> list[str]:
    """`vocab_size` distinct tokens: the specials, then words of one, two, ... syllables."""
    if vocab_size < len(SPECIALS) + 1:
        raise ValueError(f"a tokenizer needs vocab_size >= {len(SPECIALS) + 1}, got {vocab_size}")
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = (
        "".join(parts)
        for length in itertools.count(1)
        for parts in itertools.product(syllables, repeat=length)
    )
    return list(SPECIALS) + list(itertools.islice(words, vocab_size - len(SPECIALS)))


def tokenizer_json(vocab_size: int) -> dict:
    vocab = {token: i for i, token in enumerate(vocabulary(vocab_size))}
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, token in enumerate(SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": SPECIALS[0]},
    }


def write_tokenizer(model_dir: str | Path, vocab_size: int, *, max_length: int) -> list[Path]:
    """Write the three tokenizer files; returns their paths."""
    model_dir = Path(model_dir)
    unk, bos, eos = SPECIALS
    files = {
        "tokenizer.json": tokenizer_json(vocab_size),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": unk, "bos_token": bos, "eos_token": eos,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
    }
    paths = []
    for name, content in files.items():
        path = model_dir / name
        path.write_text(json.dumps(content, indent=1) + "\n")
        paths.append(path)
    return paths
