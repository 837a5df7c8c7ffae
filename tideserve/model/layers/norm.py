"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tideserve import native


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, with the statistics in float32 (bf16 sums lose too much precision).

    On the CPU, float32 and bfloat16 run as one native pass (with the residual add fused). The kernels
    are bound when the module is built or moved (``.to()``), not looked up on each of the hundreds of
    calls per step; a call only checks that x is of the weight's dtype and contiguous, which the model's
    hidden states always are, so a stray caller gets torch's answer instead of a wrong one.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._bind()

    def _bind(self) -> None:
        self._kernels = native.bind_rms_norm(self.weight.dtype, self.weight.device)
        self._heads_kernel = native.bind_rms_norm_heads(self.weight.dtype, self.weight.device)
        self._dtype = self.weight.dtype

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        self._bind()  # a new dtype or device: other kernels, or none
        return module

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
        kernels = self._kernels
        if kernels is not None and x.dtype == self._dtype and x.is_contiguous():
            out = torch.empty_like(x)
            if residual is None:
                kernels[0](x, self.weight, self.eps, out)
                return out
            kernels[1](x, residual, self.weight, self.eps, out)
            return out, residual
        if residual is None:
            return self._norm(x)
        residual = residual.add_(x)  # the residual stream is ours to reuse in place
        return self._norm(residual), residual

    def forward_heads_(self, x: torch.Tensor) -> None:
        """Normalise, in place, each head of x [T, heads * head_dim] (head_dim: this norm's width): a per-head
        norm (Qwen3's q and k norms) over its columns of the fused qkv output, a view whose rows are strided
        and whose columns are contiguous. In place, so that the rotary kernel after it reads the fused rows as
        they are; the native pass and the torch fallback differ only in the order of the sum of squares."""
        kernel = self._heads_kernel
        if kernel is not None and x.dtype == self._dtype and x.dim() == 2 and x.stride(1) == 1:
            kernel(x, self.weight, self.eps)
            return
        heads = x.unflatten(-1, (-1, self.normalized_shape[0]))
        heads.copy_(self._norm(heads))
