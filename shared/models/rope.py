"""Rotary position embedding: inverse frequencies per scaling type, a cos/sin table over every position,
and one function that rotates q and k (kernels.ops: Triton on CUDA, torch reference elsewhere), alone or
fused with the KV store.

Layout is the HF "rotate half" convention: dimension i pairs with i + rotary_dim/2.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels import ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32, on the default device) and the factor cos/sin are
    multiplied by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unknown rope scaling type '{kind}'")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the pretraining context / low_freq_factor) are slowed by `factor`, short ones
    # (below context / high_freq_factor) are kept, and the band between is blended linearly in 1/wavelength.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_ctx = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over the pretraining context.
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn_factor)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k: [T, Hkv*D] (may be views into a fused qkv output; rotated in place);
    cos_sin_cache: [max_pos, D] fp32, cos half then sin half. Returns the rotated q, k."""
    return ops.apply_rope(q, k, positions, cos_sin_cache, head_dim)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table for positions [0, max_position) on the model's device."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim = head_dim
        target = torch.get_default_device()
        # Built on CPU whatever `torch.device(...)` context the model is constructed under, so the table
        # is the same bits on every device, then moved to the model's device.
        with torch.device("cpu"):
            inv_freq, attn_factor = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cache = torch.cat((freqs.cos() * attn_factor, freqs.sin() * attn_factor), dim=-1)
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("cos_sin_cache", cache.to(target), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, out: bool = False,
                         kv_scales: tuple[float, float] = (1.0, 1.0)):
        """forward(positions, q, k), then the rotated k and v written to pool slots `loc` (k, v:
        [T, Hkv, D]); one kernel on CUDA. Every scaling type lives in the table, so all take this path.
        Returns (q, k, v); `out`: as new contiguous tensors, the inputs untouched (kernels.ops).
        kv_scales: an FP8 pool's (k_scale, v_scale) of this layer."""
        return ops.apply_rope_and_store_kv(q, k, v, positions, self.cos_sin_cache, self.head_dim, k_buf, v_buf, loc,
                                           out=out, k_scale=kv_scales[0], v_scale=kv_scales[1])
