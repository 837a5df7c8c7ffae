"""Weight quantization: ``--quantization int8`` runs every linear layer (and the LM head) as int8 GEMMs;
``--quantization int4`` keeps weights in 4-bit blocks (the LM head in 8-bit blocks) for native kernels.

Why int8 this way: on CPUs without AVX-512 or AMX, float32 GEMMs already run near the core's FMA peak and
bfloat16 is emulated (several times slower), so the only way to do the same matmuls faster is integer
arithmetic. fbgemm's dynamic int8 linear (shipped in every x86 build of torch) quantizes each step's
activations on the fly (one asymmetric 8-bit scale per call, 7-bit range so the AVX2 ``vpmaddubsw``
accumulation cannot saturate) against weights quantized once per output channel (symmetric int8); it
measured about 2x float32 on batched decode shapes and 3.5x on the 49k-row LM head. torch's weight-only
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) dequantize inside a float GEMM and
measured over 20x slower than float32 on such CPUs, so they are not used.

Why int4 as blocks: a single decode stream is bound by how fast weights stream from memory, and fbgemm
has no 4-bit kernel. Blocks of 32 weights with an fp16 scale and minimum each (GGUF's Q4_1 layout, about
5 bits per weight) read 0.6 bytes per weight against int8's 1 and float32's 4, and the embedded
SmolLM2's GGUF weights are already Q4_1, so quantizing their dequantized values gives the file's blocks
back. The LM head, the one matrix whose errors land directly on the logits, gets 8-bit blocks, as the
GGUF's own Q8_0 embedding table does. The kernels live in tideserve/native/qgemm.c.

Trade-offs, measured in docs/benchmarks.md: greedy tokens agree with the float model for most of a
generation and perplexity rises slightly; the activation scale is shared by the rows of one call, so a
request's logits depend (slightly) on its batch-mates, unlike the float path.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tideserve import native
from tideserve.config import QUANTIZATIONS
from tideserve.native import quant
from tideserve.platform import platform_for

# methods applied while the checkpoint loads (model/loader), the rest to a loaded float model
LOAD_TIME_METHODS = ("gguf", "int4")
BLOCK = 32  # weights per block of the block-quantized formats


def unavailable_reason(method: str, device: torch.device) -> str | None:
    """Why ``method`` cannot run here, or None when it can."""
    if method == "int8":
        return int8_unavailable_reason(device)
    if method in ("int4", "gguf"):
        platform = platform_for(device)
        if not platform.computes_on_host:
            return f"--quantization {method} uses tideserve's CPU kernels and does not run on {platform.device_name}"
        if not quant.available():
            return (f"--quantization {method} needs tideserve's native kernels, which need a C compiler (cc or "
                    "$CC) and TIDESERVE_NATIVE unset or 1")
    return None


def int8_unavailable_reason(device: torch.device) -> str | None:
    """Why int8 cannot run here, or None when it can."""
    platform = platform_for(device)
    if not platform.computes_on_host:
        return f"--quantization int8 uses fbgemm's CPU kernels and does not run on {platform.device_name}"
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
        # The row scaling on the way in and out as one native pass each, bound once (int8 runs on the CPU
        # in float32 only), or None: torch operators.
        self._rows = native.bind_int8_rows()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x2.dtype
        x2 = x2.float().contiguous()
        if self._rows is not None:
            rows, row_max = self._rows[0](x2, self.inv_smooth)  # the same rows in one pass
        else:
            if self.inv_smooth is not None:
                x2 = x2 * self.inv_smooth
            row_max = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
            rows = torch.cat([x2 / row_max, self.range_row])
        # reduce_range=True: 7-bit activations, so AVX2's pairwise int16 accumulation cannot saturate.
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, True)[:-1]
        if self._rows is not None:
            self._rows[1](y, row_max, self.bias)
        else:
            y = y.mul_(row_max)
            if self.bias is not None:
                y = y.add_(self.bias)
        return y.to(out_dtype).reshape(*shape[:-1], self.out_features)


@dataclass
class QuantTensor:
    """A checkpoint weight kept in its GGUF block format: ``data`` uint8 [rows, row_bytes] holds ``shape``
    ([out, in]) values as ggml's blocks of ``qtype`` (a name of native.quant.QTYPES)."""

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]


def quantize_blocks(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """weight [N, K] -> uint8 [N, row_bytes] of GGUF ``q4_1`` or ``q8_0`` blocks.

    q4_1: per block of 32, m = the block's minimum and d = its range / 15, both rounded to fp16 before the
    4-bit codes are computed, so the codes fit the stored numbers (and a Q4_1 file's dequantized values
    give its own blocks back). q8_0: d = the largest magnitude / 127.
    """
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"block-quantized weights need in_features divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if qtype == "q4_1":
        low = blocks.amin(dim=-1).clamp(-65504, 65504).half()
        d = ((blocks.amax(dim=-1) - low.float()) / 15).clamp(max=65504).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = ((blocks - low.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        qs = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
        parts = [d.view(torch.uint8).reshape(n, -1, 2), low.view(torch.uint8).reshape(n, -1, 2), qs]
    elif qtype == "q8_0":
        d = (blocks.abs().amax(dim=-1) / 127).clamp(max=65504).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        parts = [d.view(torch.uint8).reshape(n, -1, 2), codes.view(torch.uint8)]
    else:
        raise ValueError(f"weights can be quantized to q4_1 or q8_0 here, not {qtype!r}")
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def dequantize_blocks(data: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The float32 [N, K] values of GGUF blocks (the gguf package's own dequantization)."""
    import gguf

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype.upper()])
    return torch.from_numpy(values.astype("float32", copy=False).reshape(data.shape[0], in_features))


def _merge_run(qtype: str, parts: list[torch.Tensor], in_features: int, layout: str) -> torch.Tensor:
    """One segment from consecutive blocks of one format (a fused layer's shards), in ``layout``. Interleaved
    shards whose rows come in whole groups of 8 go straight into their place in the segment (the
    interleaving of a concatenation is the concatenation of the interleavings then), one copy instead of
    two: a 1.7B Q4_K_M file's load peaks 25-40 MiB lower."""
    if layout == "x8" and all(p.shape[0] % 8 == 0 for p in parts[:-1]):
        out = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=torch.uint8)
        row = 0
        for part in parts:
            quant.relayout(qtype, part, in_features, "x8", out=out[row:row + part.shape[0]])
            row += part.shape[0]
        return out
    data = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    return quant.relayout(qtype, data, in_features, "x8") if layout == "x8" else data


class QuantWeight:
    """One weight matrix [out, in] in GGUF block formats, multiplied by tideserve/native/qgemm.c.

    ``segments`` are row ranges in output order, each (qtype, uint8 [rows, row_bytes]); consecutive ones
    of one format are merged, so a fused q|k|v is one segment unless its shards differ (llama.cpp's
    Q4_K_M stores some layers' v rows as Q8_0 beside Q5_0 q and k). Each call quantizes its input to 8
    bits per block of 32, row by row (or, on AMX at 12 rows and more, rounds it to bfloat16), so a row's
    result does not depend on its batch-mates' values; on AMX it does depend on which side of 12 rows the
    batch is (the two roundings differ by about 1%, as far apart as any two dtypes). Without the native
    library the weight is dequantized and multiplied in float: slow, but the same numbers up to the input
    rounding.

    Each segment's bytes are kept in the layout the kernels read fastest on this CPU (``layouts``:
    quant.preferred_layout), reordered once here: on AVX2 and AVX-512 VNNI the legacy formats, Q8_0, Q4_K and
    Q6_K are interleaved by groups of 8 rows. The bytes are the file's either way, so ``file_segments`` gives
    them back as stored.
    """

    takes_swiglu = True  # __call__ can apply silu(gate) * up to its input on the way in

    def __init__(self, segments: list[tuple[str, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None, layouts: list[str] | None = None) -> None:
        """``segments`` as stored in the file, or, with ``layouts``, already in those layouts (copies)."""
        runs: list[tuple[str, list[torch.Tensor]]] = []  # consecutive segments of one format
        for qtype, data in segments:
            if qtype not in quant.QTYPES:
                raise ValueError(f"no kernel for block format {qtype!r}; formats: {', '.join(quant.QTYPES)}")
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != quant.row_bytes(qtype, in_features):
                raise ValueError(f"{qtype} rows of {in_features} values are {quant.row_bytes(qtype, in_features)} "
                                 f"bytes, got a {data.dtype} tensor of shape {tuple(data.shape)}")
            if runs and runs[-1][0] == qtype and layouts is None:
                runs[-1][1].append(data)
            else:
                runs.append((qtype, [data]))
        if layouts is None:
            layouts = [quant.preferred_layout(q) if sum(d.shape[0] for d in parts) >= 8 else "rows"
                       for q, parts in runs]
            merged = [(q, _merge_run(q, parts, in_features, layout)) for (q, parts), layout in zip(runs, layouts)]
        else:
            merged = [(q, parts[0].contiguous()) for q, parts in runs]
        self.segments = merged
        self.layouts = list(layouts)
        self.in_features = in_features
        self.out_features = sum(d.shape[0] for _, d in merged)
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self.nbytes = sum(d.numel() for _, d in merged) + (self.bias.numel() * 4 if self.bias is not None else 0)
        self.mat = quant.make_qmat(merged, in_features, self.bias, self.layouts)  # points into the tensors above

    def __deepcopy__(self, memo: dict) -> QuantWeight:
        """A copy owns copies of the blocks and a kernel struct pointing at them (ctypes pointers cannot be
        copied, and must never point at the original's tensors)."""
        import copy

        bias = copy.deepcopy(self.bias, memo)
        return type(self)([(q, d.clone()) for q, d in self.segments], self.in_features, bias, self.layouts)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, qtype: str = "q4_1") -> QuantWeight:
        return cls([(qtype, quantize_blocks(weight, qtype))], weight.shape[1], bias)

    @property
    def qtypes(self) -> list[str]:
        return [q for q, _ in self.segments]

    def file_segments(self) -> list[tuple[str, torch.Tensor]]:
        """The segments' blocks as the file stores them (copies where this CPU's layout differs)."""
        return [(q, d if layout == "rows" else quant.relayout(q, d, self.in_features, "rows"))
                for (q, d), layout in zip(self.segments, self.layouts)]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([dequantize_blocks(d, q, self.in_features) for q, d in self.file_segments()])

    def __call__(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]; with ``swiglu``, x is [..., 2 * in] (gate | up) and the product is
        taken with silu(gate) * up."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x2.dtype
        x2 = x2.float()
        y = quant.qmatmul(x2, self.mat, swiglu)
        if y is None:
            if swiglu:
                gate, up = x2.split(self.in_features, dim=-1)
                x2 = F.silu(gate) * up
            y = F.linear(x2, self.dequantize(), self.bias)
        return y.to(out_dtype).reshape(*shape[:-1], self.out_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the matrix (an embedding table kept quantized), float32 [*ids.shape, in]."""
        flat = ids.reshape(-1)
        if len(self.segments) == 1:
            qtype, data = self.segments[0]
            rows = quant.dequant_rows(qtype, data, self.in_features, flat, self.layouts[0])
            if rows is not None:
                return rows.reshape(*ids.shape, self.in_features)
        return F.embedding(ids, self.dequantize())


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


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: float tensors plus quantized ones (not in the state dict)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    seen: set[int] = set()  # a tied LM head is the embedding's own quantized table
    for q in [getattr(m, "qweight", None) for m in model.modules()] + [getattr(model, "lm_head_q", None)]:
        if isinstance(q, (Int8Weight, QuantWeight)) and id(q) not in seen:
            seen.add(id(q))
            total += q.nbytes
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
    from tideserve.model.attention import BatchLayout, TorchSDPABackend
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
        meta = TorchSDPABackend(device).build_metadata(BatchLayout.single_prefill(n, block))
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        model(ids, torch.arange(n, device=device), caches, meta)
    finally:
        for h in hooks:
            h.remove()
    return act_max
