"""Linear layers whose output rows may fuse several checkpoint projections (q|k|v, gate|up).

One matmul over the fused weight replaces two or three small ones; on CPU that is most of the win for
small models, whose per-call overhead dominates. Checkpoints store the projections separately, so each
layer knows its shards and copies each loaded tensor into its row range.

Quantized loading (``quantize_on_load``): shards may arrive as GGUF blocks (kept as they are) or as
floats (quantized by the hook); once every shard of the layer is in, the layer becomes a QuantWeight
and its float weight, never written to when all shards came as blocks, is dropped. So a checkpoint
is quantized one layer at a time and the float model never exists as a whole.

Tensor parallelism (``ColumnParallelLinear``, ``RowParallelLinear``): a loaded layer is split across ranks
after the load (model/tensor_parallel.py decides which rows and columns each rank keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tideserve.model.layers.quant.weights import QuantTensor, QuantWeight


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

    def load_fused(self, param_name: str, tensor: Any) -> list[str | None]:
        """Load a checkpoint tensor that holds every shard's rows, in shard order (Phi-3 stores q|k|v and
        gate|up fused), shard by shard as ``load`` would take them; returns the shard ids. GGUF blocks split
        as they are: a block never spans rows."""
        if tuple(tensor.shape[:1]) != (self.out_features,):
            sizes = ", ".join(f"{k} {n}" for k, (_, n) in self.shard_offsets.items())
            raise ValueError(f"fused {param_name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                             f"model's {self.out_features} rows ({sizes})")
        for shard_id, (offset, size) in self.shard_offsets.items():
            if isinstance(tensor, QuantTensor):
                part: Any = QuantTensor(tensor.qtype, tensor.data[offset:offset + size], (size, tensor.shape[1]))
            else:
                part = tensor.narrow(0, offset, size)
            self.load(param_name, part, shard_id)
        return list(self.shard_offsets)

    def _finish_quantized_load(self) -> None:
        """Every shard is in: assemble the QuantWeight (blocks kept, floats quantized) and drop the floats."""
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


# ----------------------------------------------------------------- tensor parallelism
class CollectiveGroup(Protocol):
    """What a tensor-parallel layer needs from its ranks (worker/parallel_state.py's ``TensorParallelGroup``)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


def _sharded(cls: type[Linear], source: Linear, weight: torch.Tensor, bias: torch.Tensor | None,
             shard_sizes: dict[str | None, int]) -> Linear:
    """A layer of class ``cls`` over new tensors ``weight`` / ``bias`` (never views of ``source``'s, which
    other engines may share): ``Linear.__init__`` would allocate the full shape first."""
    if source.qweight is not None:
        raise ValueError("a quantized layer cannot be split across tensor-parallel ranks")
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features = weight.shape[1]
    layer.shard_offsets = {}
    offset = 0
    for shard_id, size in shard_sizes.items():
        layer.shard_offsets[shard_id] = (offset, size)
        offset += size
    layer.out_features = offset
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False) if bias is not None else None
    layer.qweight = None
    layer.quantize_on_load = None
    layer._pending = {}
    return layer


class ColumnParallelLinear(Linear):
    """Output rows split across ranks (the fused q|k|v and gate|up): each rank computes its slice of y with
    no communication, because what consumes it (attention over the rank's heads, the row-parallel down
    projection) needs only that slice."""

    @classmethod
    def shard(cls, linear: Linear, rows: dict[str | None, torch.Tensor]) -> ColumnParallelLinear:
        """Keep, for each fused shard, the output rows ``rows[shard_id]`` (indices into that shard)."""
        weights, biases, sizes = [], [], {}
        for shard_id, (offset, _size) in linear.shard_offsets.items():
            index = rows[shard_id].to(linear.weight.device) + offset
            weights.append(linear.weight.index_select(0, index))
            if linear.bias is not None:
                biases.append(linear.bias.index_select(0, index))
            sizes[shard_id] = len(index)
        bias = torch.cat(biases) if linear.bias is not None else None
        return _sharded(cls, linear, torch.cat(weights), bias, sizes)


def input_slice(linear: Linear, cols: torch.Tensor) -> Linear:
    """A plain layer over the input columns ``cols`` of ``linear`` (bias-free): a row-parallel partial
    product whose all-reduce the caller does, as a mixture of experts does once for all its experts
    (model/moe.py) rather than once per expert."""
    if linear.bias is not None:
        raise ValueError("a partial product cannot carry the bias; use RowParallelLinear")
    weight = linear.weight.index_select(1, cols.to(linear.weight.device))
    return _sharded(Linear, linear, weight, None, {k: size for k, (_, size) in linear.shard_offsets.items()})


class RowParallelLinear(Linear):
    """Input columns split across ranks (o_proj over the rank's heads, down_proj over its slice of the
    MLP): each rank's product is a partial sum, all-reduced here (the one collective per attention block
    and per MLP); the bias is added once, after the sum."""

    group: CollectiveGroup

    @classmethod
    def shard(cls, linear: Linear, cols: torch.Tensor, group: CollectiveGroup) -> RowParallelLinear:
        weight = linear.weight.index_select(1, cols.to(linear.weight.device))
        bias = linear.bias.clone() if linear.bias is not None else None
        layer = _sharded(cls, linear, weight, bias, {k: size for k, (_, size) in linear.shard_offsets.items()})
        layer.group = group
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y.add_(self.bias) if self.bias is not None else y
