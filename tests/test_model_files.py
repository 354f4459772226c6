"""`runner-fsm make-model` and loading checkpoints: formats, determinism, precise errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runner_fsm.cli import main
from runner_fsm.errors import ConfigError
from runner_fsm.model import (
    MixtralConfig, UnsupportedModelError, WeightsError, load_drafter, load_model, resolve_device,
)
from runner_fsm.model_files.make import TARGET_SPEC, with_overrides
from runner_fsm.model_files.safetensors_io import load_file, save_file
from runner_fsm.model_files.shapes import expected_shapes
from runner_fsm.model_files.weights import read_checkpoint

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def _load(path, **kw):
    return load_model(path, kv_num_blocks=4, block_size=4, **kw)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("made")
    assert main(["make-model", str(root / "target")]) == 0
    assert main(["make-model", str(root / "draft"), "--draft", "--seed", "7"]) == 0
    return root


def test_make_model_writes_a_loadable_hf_checkpoint(made):
    target = made / "target"
    assert FILES <= {p.name for p in target.iterdir()}
    raw = json.loads((target / "config.json").read_text())
    assert raw["model_type"] == "mixtral" and raw["architectures"] == ["MixtralForCausalLM"]
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (128, 4, 2, 32)
    assert (raw["num_local_experts"], raw["num_experts_per_tok"], raw["vocab_size"]) == (4, 2, 512)
    state = read_checkpoint(target)
    cfg = MixtralConfig.from_dir(target)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(cfg)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in state
    model = _load(target)
    assert model.cfg == cfg and model.decoder.weights.embed.dtype == torch.float32


def test_draft_is_smaller_with_the_same_vocab(made):
    target, draft = MixtralConfig.from_dir(made / "target"), MixtralConfig.from_dir(made / "draft")
    assert (draft.num_hidden_layers, draft.hidden_size, draft.num_attention_heads, draft.head_dim) == (1, 64, 2, 32)
    assert draft.vocab_size == target.vocab_size
    load_drafter(made / "draft", kv_num_blocks=4, block_size=4, target_vocab_size=target.vocab_size)
    with pytest.raises(ConfigError, match="vocab_size=512 differs from the target's 1000"):
        load_drafter(made / "draft", kv_num_blocks=4, block_size=4, target_vocab_size=1000)


def test_weights_are_a_function_of_the_seed(tmp_path, made):
    main(["make-model", str(tmp_path / "same"), "--seed", "0"])
    main(["make-model", str(tmp_path / "other"), "--seed", "1"])
    original = (made / "target" / "model.safetensors").read_bytes()
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == original
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != original


def test_shape_flags_override_the_defaults(tmp_path):
    assert main(["make-model", str(tmp_path), "--layers", "1", "--experts", "3", "--top-k", "1",
                 "--vocab", "64", "--intermediate", "32", "--kv-heads", "1"]) == 0
    cfg = MixtralConfig.from_dir(tmp_path)
    assert (cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.vocab_size,
            cfg.intermediate_size, cfg.num_key_value_heads) == (1, 3, 1, 64, 32, 1)


def test_make_model_rejects_a_bad_shape(tmp_path, capsys):
    assert main(["make-model", str(tmp_path), "--heads", "3"]) == 2
    assert "hidden (128) divisible by heads (3)" in capsys.readouterr().err


def test_another_architecture_is_refused_by_name(tmp_path, made):
    raw = json.loads((made / "target" / "config.json").read_text())
    raw.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=r"'llama', architectures \['LlamaForCausalLM'\] is not"
                                                    r" supported.*'mixtral' \(MixtralForCausalLM\)"):
        _load(tmp_path)
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        _load(tmp_path / "missing")


def test_checkpoint_mismatches_are_named(tmp_path, made):
    (tmp_path / "config.json").write_text((made / "target" / "config.json").read_text())
    state = read_checkpoint(made / "target")
    del state["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"missing tensors \['model.layers.0.block_sparse_moe.experts.2.w3.weight'\]"):
        _load(tmp_path)
    state = read_checkpoint(made / "target")
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model.norm.weight has shape \[7\], config.json implies \[128\]"):
        _load(tmp_path)


def test_tied_embeddings_need_no_lm_head(tmp_path, made):
    raw = json.loads((made / "target" / "config.json").read_text())
    raw["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    state = read_checkpoint(made / "target")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors")
    weights = _load(tmp_path).decoder.weights
    assert weights.lm_head is weights.embed


def test_safetensors_round_trip_covers_the_dtypes(tmp_path):
    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(), "f16": torch.randn(2, 2).half(),
               "i64": torch.arange(6).reshape(2, 3), "empty": torch.zeros(0, 3)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_files_read_with_the_safetensors_package(tmp_path, made):
    st = pytest.importorskip("safetensors.torch")
    ours = read_checkpoint(made / "target")
    theirs = st.load_file(str(made / "target" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    st.save_file({"a": torch.randn(4, 2), "b": torch.arange(3)}, str(tmp_path / "t.safetensors"))
    assert torch.equal(load_file(tmp_path / "t.safetensors")["b"], torch.arange(3))


def test_tokenizer_loads_with_the_tokenizers_package(made):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(made / "target" / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    ids = tok.encode("ba be bi").ids
    assert ids == [3, 4, 5] and tok.decode(ids) == "ba be bi"
    assert tok.token_to_id("</s>") == 2 and tok.id_to_token(511) is not None


def test_greedy_margins_are_wide(made):
    """Most rows' top-2 logit gap dwarfs float32 rounding, so layouts cannot flip tokens."""
    model = _load(made / "target")
    weights = model.decoder.weights
    hidden = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    logits = model.logits(hidden / hidden.pow(2).mean(-1, keepdim=True).sqrt() * weights.norm)
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).numpy()
    assert np.median(gaps) > 0.5 and np.quantile(gaps, 0.05) > 1e-2


def test_devices_are_checked_before_use():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs torch_npu"):
            resolve_device("npu:0")
    assert resolve_device("cpu") == torch.device("cpu")
    assert with_overrides(TARGET_SPEC, layers=None, vocab=8).vocab == 8
