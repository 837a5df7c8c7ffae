"""SmoothQuant calibration for ``--quantization int8``: the largest input magnitude per channel of every
linear layer, over one float forward pass of a fixed text. ``quantize_model`` divides those channels'
outliers into the weights, which are quantized per channel and absorb them better."""

from __future__ import annotations

import torch
from torch import nn

from tideserve.model.attention import BatchLayout, TorchSDPABackend
from tideserve.model.layers.linear import Linear

# Calibration text for SmoothQuant's activation ranges: prose, code, numbers and a chat turn, so the
# outlier channels that any of them light up are covered.
CALIBRATION_TEXT = (
    "<|im_start|>user\nExplain how a bicycle gear works, then give three tips for riding at night.<|im_end|>\n"
    "<|im_start|>assistant\nA bicycle gear trades force for speed: a small front ring and a large rear cog "
    "make each turn of the pedals easier but slower. At night, use a white front light and a red rear "
    "light, wear something reflective, and ride where drivers expect you.<|im_end|>\n"
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files), sum(1 for f in files))\n"
    "Totals for 2024: 3.14159, 2,718 units, 1e-5 tolerance, 42% growth; see table 7 (page 12).\n"
    "The committee met on Tuesday. After a long debate the members voted to repair the old bridge first."
)


@torch.inference_mode()
def calibrate(model: nn.Module, token_ids: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """Largest input magnitude per channel of every linear layer, over one float forward pass."""
    act_max: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module, inputs, _output) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float().cpu()
            act_max[name] = torch.maximum(act_max[name], x) if name in act_max else x
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, Linear)]
    try:
        n = len(token_ids)
        arch = model.arch
        block = 16
        shape = (-(-n // block), block, arch.num_key_value_heads, arch.head_dim)
        caches = [(torch.empty(shape, dtype=model.dtype, device=device),
                   torch.empty(shape, dtype=model.dtype, device=device)) for _ in range(arch.num_hidden_layers)]
        meta = TorchSDPABackend(device).build_metadata(BatchLayout.single_prefill(n, block))
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        model(ids, torch.arange(n, device=device), caches, meta)
    finally:
        for h in hooks:
            h.remove()
    return act_max
