"""Rotary position embedding, HF/NEOX "rotate_half" layout, with a precomputed cos/sin cache.

The cache is indexed once per forward by the flat ``positions`` tensor and shared by all layers, so the
per-layer cost is a few elementwise ops on the fused q|k projection.

Partial rotary (``rotary_dim`` < head_dim, Phi-4-mini): only the first ``rotary_dim`` values of each head
rotate, rotate-half within them; the cache then holds ``rotary_dim // 2`` columns, which is how the
kernels that take it (rope_store.c) know the rotated width.

LongRoPE (Phi-3/Phi-4 "longrope"): the inverse frequencies are divided by per-frequency ``short_factor``s or
``long_factor``s and cos/sin multiplied by an attention factor. transformers switches the whole sequence
from short to long once it grows past ``original_max_position_embeddings``, which re-rotates keys already
computed; a paged cache cannot follow that (a cached block would depend on how long the requests reusing
it later grow, so prefix caching would hand out keys rotated for another length). Here one set serves
every position of a model: long when the table reaches past the original context (``max_positions >
original_max_position_embeddings``), else short: a key depends on its position only. vLLM (by
max_model_len) and llama.cpp (by the context size) decide the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 (``head_dim``: the rotated width), with HF's
    llama3/linear/longrope scaling or GGUF factors; longrope picks its factors by ``max_positions``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(longrope_factors(scaling, max_positions), dtype=torch.float32)
        if factors.numel() != exponents.numel():
            raise ValueError(f"longrope has {factors.numel()} factors, expected {exponents.numel()}")
        return 1.0 / (factors * theta ** exponents)  # HF's order of operations, for the same float32 values
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported")


def longrope_factors(scaling: dict[str, Any], max_positions: int | None) -> list[float]:
    """The longrope factors for a table of ``max_positions``: long when it reaches past the original
    context, else short (see the module docstring for why one set serves every position)."""
    original = int(scaling["original_max_position_embeddings"])
    use_long = max_positions is not None and max_positions > original
    return [float(f) for f in scaling["long_factor" if use_long else "short_factor"]]


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for positions [0, max_positions) as [max_positions, rotary_dim // 2] in the model dtype
    (HF also casts cos/sin to the activation dtype before the multiply). ``rotary_dim`` None: the whole head."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and at most head_dim={head_dim}")
        inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        attention_factor = float((scaling or {}).get("attention_factor", 1.0))
        if attention_factor != 1.0:  # longrope: scales q.k by its square, as HF's cos/sin scaling does
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_cache", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype=dtype, device=device), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cache.shape[0]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, rotary_dim // 2], ready to broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, N, D] in place (x may be a view into the fused qkv output, which we own), or, for
    partial rotary, its first D' = 2 * cos.shape[-1] values of each head (the rest are left as they are).

    Same result as HF's ``x * cos_full + rotate_half(x) * sin_full`` with cos_full = cat(cos, cos).
    """
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half: 2 * half]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x1.copy_(o1)
    x2.copy_(o2)
    return x
