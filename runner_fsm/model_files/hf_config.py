"""The Hugging Face `config.json` of a Mixtral checkpoint, read into a frozen value."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from runner_fsm.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPE = "mixtral"
SUPPORTED_ARCHITECTURE = "MixtralForCausalLM"
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
    """Shape of a Mixtral decoder; identical on every rank that loads the same directory."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        self.validate()

    @property
    def queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate(self) -> "MixtralConfig":
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "num_local_experts",
                    "num_experts_per_tok", "head_dim")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"config.json: {name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of"
                f" num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise UnsupportedModelError(
                f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds"
                f" num_local_experts={self.num_local_experts}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"config.json: rotary embeddings need an even head_dim, got {self.head_dim}")
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = CONFIG_FILE) -> "MixtralConfig":
        _check_architecture(raw, source)
        _check_implemented(raw, source)
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise UnsupportedModelError(f"{source}: missing required Mixtral fields {missing}")
        fields = {k: raw[k] for k in _REQUIRED}
        fields["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        for name in _OPTIONAL:
            if raw.get(name) is not None:
                fields[name] = raw[name]
        theta = _rope_parameters_theta(raw, source)
        if theta is not None:
            fields["rope_theta"] = theta
        return cls(**fields)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "MixtralConfig":
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir}: no {CONFIG_FILE}; expected a Hugging Face model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UnsupportedModelError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` Hugging Face and vLLM read for this shape."""
        out = dataclasses.asdict(self)
        out.update(
            model_type=SUPPORTED_MODEL_TYPE,
            architectures=[SUPPORTED_ARCHITECTURE],
            hidden_act="silu",
            sliding_window=None,
            attention_dropout=0.0,
            initializer_range=0.02,
            output_router_logits=False,
            router_aux_loss_coef=0.0,
            use_cache=True,
        )
        return out


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok")
_OPTIONAL = ("rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
             "torch_dtype", "bos_token_id", "eos_token_id")


# Fields of Hugging Face configs that change what the model computes, which the reference model
# does not implement, with the values under which it computes the same thing anyway. Any other
# value is refused by name: computing as if it were unset would be another model, silently.
_NEUTRAL_VALUES: dict[str, tuple] = {
    "sliding_window": (None,),  # attention over a window of recent tokens only
    "rope_scaling": (None,),  # scaled rotary positions (linear, dynamic, yarn, llama3, ...)
    "hidden_act": (None, "silu"),  # the experts' activation
    "partial_rotary_factor": (None, 1, 1.0),  # rotary embedding on part of each head
    "attention_bias": (None, False),  # biases on the q/k/v/o projections
    "mlp_bias": (None, False),
    "quantization_config": (None,),  # quantised weights
}
_DEFAULT_ROPE_TYPES = (None, "default")


def _check_implemented(raw: dict[str, Any], source: str) -> None:
    """`UnsupportedModelError` naming every field set to something the model does not compute."""
    unsupported = [f"{name}={raw[name]!r}" for name, neutral in _NEUTRAL_VALUES.items()
                   if name in raw and not _is_neutral(raw[name], neutral)]
    rope = raw.get("rope_parameters")  # transformers >= 5: {"rope_type", "rope_theta", ...}
    if rope is not None and (not isinstance(rope, dict)
                             or rope.get("rope_type", rope.get("type")) not in _DEFAULT_ROPE_TYPES):
        unsupported.append(f"rope_parameters={rope!r}")
    if unsupported:
        raise UnsupportedModelError(
            f"{source}: {', '.join(unsupported)}: runner_fsm.model does not implement"
            f" {'this' if len(unsupported) == 1 else 'these'}, and computing as if unset would be another model")


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """`value` is one of `neutral`, of the same type (True is no 1, 1.0 no True)."""
    return any(value is n if n is None else (type(value) is type(n) and value == n) for n in neutral)


def _rope_parameters_theta(raw: dict[str, Any], source: str) -> float | None:
    """The rotary base from transformers 5's `rope_parameters`, when the config keeps it there."""
    rope = raw.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    top = raw.get("rope_theta")
    if theta is not None and top is not None and float(theta) != float(top):
        raise UnsupportedModelError(f"{source}: rope_theta={top!r} and rope_parameters.rope_theta={theta!r}"
                                    " disagree")
    return theta


def _check_architecture(raw: dict[str, Any], source: str) -> None:
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type == SUPPORTED_MODEL_TYPE or SUPPORTED_ARCHITECTURE in architectures:
        return
    raise UnsupportedModelError(
        f"{source}: model_type {model_type!r}, architectures {architectures} is not supported;"
        f" runner_fsm.model implements model_type {SUPPORTED_MODEL_TYPE!r}"
        f" ({SUPPORTED_ARCHITECTURE}) only")
