"""The bytes a model's weights occupy, quantized matrices included: the KV pool's memory account subtracts
them, and the start-up log reports them. A quantized matrix is no tensor of the state dict, so summing
the state dict alone would miss it."""

from __future__ import annotations

from torch import nn

from tideserve.model.layers.quant.weights import Int8Weight, QuantWeight


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: float tensors plus quantized ones (not in the state dict)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    seen: set[int] = set()  # a tied LM head is the embedding's own quantized table
    for q in [getattr(m, "qweight", None) for m in model.modules()] + [getattr(model, "lm_head_q", None)]:
        if isinstance(q, (Int8Weight, QuantWeight)) and id(q) not in seen:
            seen.add(id(q))
            total += q.nbytes
    return total
