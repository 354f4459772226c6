"""Stateless tensor functions of the decoder: norm, rotary positions, SwiGLU, masked attention.

Reductions and softmax run in `compute_dtype` (float32, or float64 for a float64 model), so
half-precision weights lose nothing there and a float64 reference run stays float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(compute_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def rope_inv_freq(head_dim: int, theta: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    dt = compute_dtype(dtype)
    exponents = torch.arange(0, head_dim, 2, dtype=dt, device=device) / head_dim
    return 1.0 / (theta ** exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] at each position (the half-split rotary layout)."""
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [N, heads, head_dim] by the per-row angles."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where `mask` holds; a row with no key stays finite (uniform).

    A finite fill instead of -inf: padding and dummy rows may see no key at all, and must
    produce numbers, not NaNs, because their outputs still travel through the collectives.
    """
    return torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, d] against shared keys k, v [L, Hkv, d]; mask [n, L] -> [n, H, d]."""
    n, heads, d = q.shape
    dt = compute_dtype(q.dtype)
    qg = q.to(dt).reshape(n, k.shape[1], heads // k.shape[1], d)
    scores = torch.einsum("nkgd,lkd->nkgl", qg, k.to(dt)) * d ** -0.5
    probs = masked_softmax(scores, mask[:, None, None, :])
    out = torch.einsum("nkgl,lkd->nkgd", probs, v.to(dt))
    return out.reshape(n, heads, d).to(q.dtype)


def per_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, d] against per-row keys k, v [n, L, Hkv, d]; mask [n, L] -> [n, H, d]."""
    n, heads, d = q.shape
    dt = compute_dtype(q.dtype)
    qg = q.to(dt).reshape(n, k.shape[2], heads // k.shape[2], d)
    scores = torch.einsum("nkgd,nlkd->nkgl", qg, k.to(dt)) * d ** -0.5
    probs = masked_softmax(scores, mask[:, None, None, :])
    out = torch.einsum("nkgl,nlkd->nkgd", probs, v.to(dt))
    return out.reshape(n, heads, d).to(q.dtype)
