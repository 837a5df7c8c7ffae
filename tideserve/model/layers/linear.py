"""Linear layers whose output rows may fuse several checkpoint projections (q|k|v, gate|up).

One matmul over the fused weight replaces two or three small ones; on CPU that is most of the win for
small models, whose per-call overhead dominates. Checkpoints store the projections separately, so each
layer knows its shards and copies each loaded tensor into its row range.

Quantized loading (``quantize_on_load``): shards may arrive as GGUF blocks (kept as they are) or as
floats (quantized by the hook); once every shard of the layer is in, the layer becomes a QuantWeight
and its float weight, never written to when all shards came as blocks, is dropped. So a checkpoint
is quantized one layer at a time and the float model never exists as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
        self.qweight: Any = None  # Int8Weight / QuantWeight once quantized (the float weight is then dropped)
        # Set by the loader for quantized loading: float shard [rows, in] -> (qtype, uint8 blocks).
        self.quantize_on_load: Callable[[torch.Tensor], tuple[str, torch.Tensor]] | None = None
        self._pending: dict[tuple[str, str | None], Any] = {}

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

    def load(self, param_name: str, tensor: Any, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor ("weight" or "bias") into the rows of ``shard_id``; shapes must match.
        ``tensor`` may be a QuantTensor (GGUF blocks) when the loader set ``quantize_on_load``."""
        if self.qweight is not None:
            raise ValueError("weights cannot be loaded into a quantized layer; load, then quantize")
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a layer built without one")
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        target_shape = (size, self.in_features) if param_name == "weight" else (size,)
        if tuple(target_shape) != tuple(tensor.shape):
            raise ValueError(
                f"{param_name} shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} does not match the "
                f"model's {tuple(target_shape)}"
            )
        if self.quantize_on_load is not None:  # weights wait for their layer's other shards, untouched
            if param_name == "bias":
                param.data.narrow(0, offset, size).copy_(tensor)
            self._pending[(param_name, shard_id)] = tensor
            if len(self._pending) == len(self.shard_offsets) * (2 if self.bias is not None else 1):
                self._finish_quantized_load()
            return
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{param_name} shard {shard_id!r}: GGUF blocks need a quantized load")
        param.data.narrow(0, offset, size).copy_(tensor)

    def _finish_quantized_load(self) -> None:
        """Every shard is in: assemble the QuantWeight (blocks kept, floats quantized) and drop the floats."""
        from tideserve.model.layers.quantization import QuantTensor, QuantWeight

        segments = []
        for shard_id in self.shard_offsets:
            shard = self._pending[("weight", shard_id)]
            segments.append((shard.qtype, shard.data) if isinstance(shard, QuantTensor)
                            else self.quantize_on_load(shard.float()))
        self.qweight = QuantWeight(segments, self.in_features, self.bias)
        self.weight = None
        self.bias = None
        self._pending.clear()
        self.quantize_on_load = None
