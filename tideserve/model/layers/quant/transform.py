"""``quantize_model``: a quantized copy of a loaded float model (``--quantization int8`` and ``int4`` on a
float checkpoint), sharing the original's float tensors, so one loaded model can serve float and quantized
engines at once."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tideserve.config import QUANTIZATIONS
from tideserve.model.layers.linear import Linear
from tideserve.model.layers.quant.blocks import BLOCK
from tideserve.model.layers.quant.methods import unavailable_reason
from tideserve.model.layers.quant.weights import Int8Weight, QuantWeight


def quantize_model(model: nn.Module, method: str, device: torch.device,
                   act_max: dict[str, torch.Tensor] | None = None, alpha: float = 0.7) -> tuple[nn.Module, int]:
    """A quantized model and the weight bytes saved; ``model`` itself is left as it was.

    The returned model is a copy of the module tree sharing every float tensor it keeps (norms,
    embeddings) with the original, so a model loaded once can serve float and quantized engines. Its
    linear layers hold packed int8 weights instead of float ones, and the LM head gets an int8 copy;
    embedding lookups stay in float. ``act_max`` (per linear layer name, the largest input magnitude
    per channel, from ``calibrate``) turns on SmoothQuant with migration strength ``alpha``.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}.")
    if method == "none":
        return model, 0
    if method in ("auto", "gguf"):
        raise ValueError(f"quantization {method!r} keeps a GGUF file's own blocks and is applied while the file "
                         "loads (load_model), not to a loaded float model")
    reason = unavailable_reason(method, device)
    if reason:
        raise ValueError(reason + "; use --quantization none.")
    shared = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    model = copy.deepcopy(model, memo=shared)
    saved = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.qweight is None:
            smooth = None
            if act_max is not None and name in act_max:
                w_max = module.weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
                smooth = (act_max[name].float().clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)
            if method == "int4":
                if module.in_features % BLOCK:
                    raise ValueError(f"--quantization int4 needs every linear layer's input size to be divisible "
                                     f"by {BLOCK}; {name} takes {module.in_features}. Use --quantization int8.")
                module.qweight = QuantWeight.from_float(module.weight, module.bias, "q4_1")
            else:
                module.qweight = Int8Weight(module.weight, module.bias, smooth)
            saved += module.weight.numel() * module.weight.element_size() - module.qweight.nbytes
            module.weight = None
            module.bias = None
    if hasattr(model, "quantize_lm_head"):
        saved += model.quantize_lm_head(
            (lambda w: QuantWeight.from_float(w, qtype="q8_0")) if method == "int4" else Int8Weight)
    if method == "int4" and hasattr(model, "enable_native_decode"):
        model.enable_native_decode()
    return model, saved
