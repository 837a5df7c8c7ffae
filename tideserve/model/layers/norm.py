"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with the statistics in float32 (bf16 sums lose too much precision) and the
    result cast back before the weight multiply, as in HF Llama."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual); the sum is done in the
        model dtype, like HF's ``hidden = residual + hidden``."""
        if residual is None:
            return self._norm(x)
        residual = residual.add_(x)  # the residual stream is ours to reuse in place
        return self._norm(residual), residual
