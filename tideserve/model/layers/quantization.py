"""Weight quantization: ``--quantization int8`` runs every linear layer (and the LM head) as int8 GEMMs.

Why this method: on CPUs without AVX-512 or AMX, float32 GEMMs already run near the core's FMA peak and
bfloat16 is emulated (several times slower), so the only way to do the same matmuls faster is integer
arithmetic. fbgemm's dynamic int8 linear (shipped in every x86 build of torch) quantizes each step's
activations on the fly (one asymmetric 8-bit scale per call, 7-bit range so the AVX2 ``vpmaddubsw``
accumulation cannot saturate) against weights quantized once per output channel (symmetric int8); it
measured about 2x float32 on batched decode shapes and 3.5x on the 49k-row LM head. torch's weight-only
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) dequantize inside a float GEMM and
measured over 20x slower than float32 on such CPUs, so they are not used.

Trade-offs, measured in docs/benchmarks.md: greedy tokens agree with the float model for most of a
generation and perplexity rises slightly; the activation scale is shared by the rows of one call, so a
request's logits depend (slightly) on its batch-mates, unlike the float path.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from tideserve import native

QUANTIZATION_METHODS = ("none", "int8")


def int8_unavailable_reason(device: torch.device) -> str | None:
    """Why int8 cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"--quantization int8 uses fbgemm's CPU kernels and does not run on {device.type}"
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines and "x86" not in engines:
        return f"--quantization int8 needs torch's fbgemm/x86 quantized engine; this build has {engines}"
    return None


class Int8Weight:
    """One weight matrix [out, in] as int8 (a scale per output channel), packed for fbgemm.

    Activations are quantized per row (token): each row is divided by its largest magnitude before
    fbgemm's per-call quantization, and one constant row holding +1 and -1 pins that call's range to
    [-1, 1], so every token gets its own scale and a request's result does not depend on its
    batch-mates. ``smooth`` (SmoothQuant) divides the input channels by per-channel factors that are
    multiplied into the weight's columns, moving activation outliers into the weights, which are
    quantized per channel and absorb them better.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None) -> None:
        w = weight.detach().float()
        self.inv_smooth = None
        if smooth is not None:
            w = w * smooth[None, :]
            self.inv_smooth = (1.0 / smooth).float()
        w = w.contiguous()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are how fbgemm's packing API takes weights
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = bias.detach().float() if bias is not None else None
        self.out_features, self.in_features = w.shape
        self.range_row = torch.zeros(1, self.in_features)
        self.range_row[0, 0], self.range_row[0, -1] = 1.0, -1.0
        self.nbytes = w.numel() + 8 * w.shape[0] + (4 * self.in_features if smooth is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x2.dtype
        x2 = x2.float()
        prepared = native.int8_rows(x2, self.inv_smooth)  # the same rows in one pass, where it can run
        if prepared is not None:
            rows, row_max = prepared
        else:
            if self.inv_smooth is not None:
                x2 = x2 * self.inv_smooth
            row_max = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
            rows = torch.cat([x2 / row_max, self.range_row])
        # reduce_range=True: 7-bit activations, so AVX2's pairwise int16 accumulation cannot saturate.
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, True)[:-1]
        if not native.scale_rows_(y, row_max, self.bias):
            y = y.mul_(row_max)
            if self.bias is not None:
                y = y.add_(self.bias)
        return y.to(out_dtype).reshape(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, method: str, device: torch.device,
                   act_max: dict[str, torch.Tensor] | None = None, alpha: float = 0.7) -> tuple[nn.Module, int]:
    """A quantized model and the weight bytes saved; ``model`` itself is left as it was.

    The returned model is a copy of the module tree sharing every float tensor it keeps (norms,
    embeddings) with the original, so a model loaded once can serve float and quantized engines. Its
    linear layers hold packed int8 weights instead of float ones, and the LM head gets an int8 copy;
    embedding lookups stay in float. ``act_max`` (per linear layer name, the largest input magnitude
    per channel, from ``calibrate``) turns on SmoothQuant with migration strength ``alpha``.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}.")
    if method == "none":
        return model, 0
    reason = int8_unavailable_reason(device)
    if reason:
        raise ValueError(reason + "; use --quantization none.")
    from tideserve.model.layers.linear import Linear

    shared = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    model = copy.deepcopy(model, memo=shared)
    saved = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.qweight is None:
            smooth = None
            if act_max is not None and name in act_max:
                w_max = module.weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
                smooth = (act_max[name].float().clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp_min(1e-5)
            module.qweight = Int8Weight(module.weight, module.bias, smooth)
            saved += module.weight.numel() * module.weight.element_size() - module.qweight.nbytes
            module.weight = None
            module.bias = None
    if hasattr(model, "quantize_lm_head"):
        saved += model.quantize_lm_head()
    return model, saved


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: float tensors plus packed int8 ones (not in the state dict)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if isinstance(q, Int8Weight):
            total += q.nbytes
    head = getattr(model, "lm_head_q", None)
    if isinstance(head, Int8Weight):
        total += head.nbytes
    return total


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
    from tideserve.model.layers.attention import AttentionMetadata, PrefillSpan
    from tideserve.model.layers.linear import Linear

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
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device))
        meta.prefills.append(PrefillSpan(start=0, query_len=n, context_len=n))
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        model(ids, torch.arange(n, device=device), caches, meta)
    finally:
        for h in hooks:
            h.remove()
    return act_max
