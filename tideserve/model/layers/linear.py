"""Linear layers whose output rows may fuse several checkpoint projections (q|k|v, gate|up).

One matmul over the fused weight replaces two or three small ones; on CPU that is most of the win for
small models, whose per-call overhead dominates. Checkpoints store the projections separately, so each
layer knows its shards and copies each loaded tensor into its row range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b), W: [sum(shard sizes), in_features]. A single-shard layer uses shard id None."""

    def __init__(self, in_features: int, shards: dict[str | None, int] | int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if isinstance(shards, int):
            shards = {None: shards}
        self.in_features = in_features
        self.shard_offsets: dict[str | None, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(offset, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(offset, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.qweight = None  # an Int8Weight once the model is quantized (the float weight is then dropped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight(x)
        return F.linear(x, self.weight, self.bias)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up = [..., 2 * in_features]: in one pass where the quantized
        weight's kernel takes the activation on its way in, which saves a tensor and two operators."""
        if getattr(self.qweight, "takes_swiglu", False):
            return self.qweight(gate_up, swiglu=True)
        gate, up = gate_up.split(self.in_features, dim=-1)
        return self(F.silu(gate).mul_(up))

    def load(self, param_name: str, tensor: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor ("weight" or "bias") into the rows of ``shard_id``; shapes must match."""
        if self.qweight is not None:
            raise ValueError("weights cannot be loaded into a quantized layer; load, then quantize")
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a layer built without one")
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{param_name} shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} does not match the "
                f"model's {tuple(target.shape)}"
            )
        target.copy_(tensor)
