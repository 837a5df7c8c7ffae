"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tideserve import native


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with the statistics in float32 (bf16 sums lose too much precision)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates low-precision inputs in float32 and, for float32, is bitwise
        # equal to HF's formula; in bf16 it can differ from HF by one ulp (it applies the weight before
        # rounding), which costs nothing in quality and saves four kernel launches per norm.
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual); the sum is done in the
        model dtype, like HF's ``hidden = residual + hidden``."""
        out = native.rms_norm(x, self.weight, self.eps, residual)  # one pass on CPU float32; else None
        if out is not None:
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual.add_(x)  # the residual stream is ours to reuse in place
        return self._norm(residual), residual
