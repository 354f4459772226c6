"""Bad input never reaches the model: prompt token ids outside [0, vocab) are refused before any
step (one line, exit status 2), and model configs that set fields the reference model does not
implement (`sliding_window`, `rope_scaling`, ...) are refused by name instead of computed as if
those fields were unset."""

import json
import shutil

import pytest

from runner_fsm.cli import main
from runner_fsm.engine.api import run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request
from runner_fsm.engine.scheduler import RequestRefused
from runner_fsm.config import ParallelLayout
from runner_fsm.model import MixtralConfig, UnsupportedModelError

VOCAB = 512  # TARGET_SPEC's


@pytest.mark.parametrize("token, position", [(VOCAB, 2), (99999, 2), (-1, 2)])
def test_a_prompt_token_outside_the_vocabulary_is_refused_before_any_step(models, tmp_path, token, position):
    target, _ = models
    cfg = EngineConfig(model_dir=target, run_dir=str(tmp_path / "run"), layout=ParallelLayout(2, 1))
    requests = [Request("fine", (1, 2, 3), 2), Request("bad", (5, 6, token, 7), 2)]
    with pytest.raises(RequestRefused, match=rf"request 'bad': prompt token id {token} at position {position}"
                                             rf" is outside the vocabulary \[0, {VOCAB}\)"):
        run_engine(cfg, requests)
    assert not (tmp_path / "run").exists()  # no process started, no log written


def test_the_highest_token_id_is_accepted(models, tmp_path):
    target, _ = models
    cfg = EngineConfig(model_dir=target, run_dir=str(tmp_path / "run"))
    result = run_engine(cfg, [Request("edge", (0, VOCAB - 1), 1)])
    assert result.ok and len(result.outputs["edge"]) == 1


def test_the_cli_refuses_a_bad_trace_in_one_line(models, tmp_path, capsys):
    target, _ = models
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"id": "x", "prompt_token_ids": [1, 99999], "max_new_tokens": 2}) + "\n")
    assert main(["run", "--model", target, "--trace", str(trace), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("runner-fsm run: RequestRefused: replica 0: request 'x': prompt token id 99999 at position 1"
                   f" is outside the vocabulary [0, {VOCAB})\n")


# ---------------------------------------------------------------- model configs

BASE = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_local_experts": 2, "num_experts_per_tok": 1}


@pytest.mark.parametrize("field, value", [
    ("sliding_window", 4096),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    ("hidden_act", "gelu"),
    ("partial_rotary_factor", 0.5),
    ("attention_bias", True),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_an_unimplemented_config_field_is_refused_by_name(field, value):
    with pytest.raises(UnsupportedModelError, match=rf"{field}=.*runner_fsm.model does not implement this"):
        MixtralConfig.from_dict({**BASE, field: value})


def test_every_unimplemented_field_is_named_at_once():
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=4096, rope_scaling=\{'factor': 2.0\}: .* these"):
        MixtralConfig.from_dict({**BASE, "sliding_window": 4096, "rope_scaling": {"factor": 2.0}})


def test_neutral_values_and_transformers_defaults_are_accepted():
    from transformers import MixtralConfig as HFMixtralConfig

    raw = HFMixtralConfig(**{k: v for k, v in BASE.items() if k not in ("model_type", "architectures")}).to_dict()
    assert raw["sliding_window"] is None and raw["hidden_act"] == "silu"
    cfg = MixtralConfig.from_dict({**raw, "model_type": "mixtral"})
    assert cfg.rope_theta == raw.get("rope_theta", raw.get("rope_parameters", {}).get("rope_theta"))
    MixtralConfig.from_dict({**BASE, "sliding_window": None, "rope_scaling": None, "attention_bias": False,
                             "partial_rotary_factor": 1.0})


def test_rope_theta_is_read_from_rope_parameters():
    cfg = MixtralConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert cfg.rope_theta == 10000.0
    with pytest.raises(UnsupportedModelError, match="disagree"):
        MixtralConfig.from_dict({**BASE, "rope_theta": 5.0, "rope_parameters": {"rope_theta": 10000.0}})


def test_the_cli_refuses_a_sliding_window_model_in_one_line(models, tmp_path, capsys):
    target, _ = models
    shutil.copytree(target, tmp_path / "model")
    config = tmp_path / "model" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "sliding_window": 32}))
    assert main(["run", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "UnsupportedModelError" in err and "sliding_window=32" in err and len(err.splitlines()) == 1
