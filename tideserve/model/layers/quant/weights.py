"""The quantized weight matrices a linear layer calls in place of its float weight: ``Int8Weight``
(``--quantization int8``) and ``QuantWeight`` (GGUF blocks: ``int4``, ``gguf``), and ``QuantTensor``, a
checkpoint tensor kept in its blocks until its layer is assembled.

Why int8 this way: on CPUs without AVX-512 or AMX, float32 GEMMs already run near the core's FMA peak and
bfloat16 is emulated (several times slower), so the only way to do the same matmuls faster is integer
arithmetic. fbgemm's dynamic int8 linear (shipped in every x86 build of torch) quantizes each step's
activations on the fly (one asymmetric 8-bit scale per call, 7-bit range so the AVX2 ``vpmaddubsw``
accumulation cannot saturate) against weights quantized once per output channel (symmetric int8); it
measured about 2x float32 on batched decode shapes and 3.5x on the 49k-row LM head. torch's weight-only
kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) dequantize inside a float GEMM and
measured over 20x slower than float32 on such CPUs, so they are not used.

This module imports no layer: the layers import it (model/layers/linear.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tideserve import native
from tideserve.model.layers.quant.blocks import dequantize_blocks, quantize_blocks
from tideserve.native import quant


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
