"""GGUF checkpoints: metadata -> ArchConfig, tensors renamed to HF names and dequantized to float32, or
kept as the file's own blocks for the quantized kernels (``--quantization gguf``, the default for
quantized files).

What differs by family (tensor names, which q/k rows llama.cpp's converter permuted to its interleaved
rotary layout) is read from the file's ``ModelFamily`` (``tideserve/model/families/``); this module only
applies it: names mapped, permuted rows put back in HF's rotate-half order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gguf
import numpy as np
import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.loader.gguf_index import GGUFIndex, GGUFTensorInfo, read_gguf_index
from tideserve.model.registry import ModelFamily, family_for, resolve_model_class

logger = logging.getLogger(__name__)


def hf_name(gguf_name: str, family: ModelFamily | None = None) -> str:
    """GGUF tensor name -> the family's checkpoint name (default: the llama family's); unknown names raise
    ValueError."""
    family = family or family_for("llama")
    name = family.gguf_tensors.hf_name(gguf_name) if family.gguf_tensors is not None else None
    if name is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not a known {family.name}-family tensor")
    return name


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows (head, half, i) were stored as (head, i, half)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def dequantize_tensor(t: GGUFTensorInfo) -> torch.Tensor:
    """Any type the gguf package can dequantize -> float32 tensor in row-major (HF) shape [out, in]."""
    arr = gguf.quants.dequantize(t.read_array(), t.tensor_type)
    shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def read_blocks(t: GGUFTensorInfo) -> torch.Tensor:
    """A quantized tensor's bytes, uint8 [rows, row_bytes], read from the file into memory we own."""
    rows = int(np.prod(t.shape[1:], dtype=np.int64))
    out = torch.empty(rows, t.n_bytes // max(rows, 1), dtype=torch.uint8)
    t.read_into(memoryview(out.numpy()).cast("B"))
    return out


def gguf_qtype(t: GGUFTensorInfo) -> str:
    """The tensor type's name as native.quant.QTYPES spells it ("q4_k", "f32", ...)."""
    return t.tensor_type.name.lower()


def iter_gguf_weights(index: GGUFIndex, arch: ArchConfig,
                      keep: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, tensor) one at a time, so peak memory stays about one tensor above the model.

    Tensors are float32, except where ``keep(hf name, qtype)`` is true: those come as QuantTensor, the
    file's own blocks, with permuted q/k rows put back in HF order all the same.
    """
    from tideserve.model.layers.quant.weights import QuantTensor

    family = family_for(arch.architecture)  # a llama file with experts is read as Mixtral
    if family.gguf_tensors is None:
        raise ValueError(f"model family {family.name!r} declares no GGUF tensor names")
    skipped = family.gguf_tensors.skipped
    unpermute = tuple(family.gguf_unpermute.items())
    for t in index.tensors:
        if t.name in skipped:
            continue
        name = hf_name(t.name, family)
        qtype = gguf_qtype(t)
        shape = tuple(reversed(t.shape))
        if len(shape) == 3:
            yield from _split_experts(t, name, shape, keep)
            continue
        heads = None
        if len(shape) == 2:
            heads = next((getattr(arch, count) for suffix, count in unpermute if name.endswith(suffix)), None)
        if keep is not None and len(shape) == 2 and keep(name, qtype):
            data = read_blocks(t)
            if heads is not None:  # whole rows move, so blocks survive the permutation as they are
                data = unpermute_qk(data, heads).contiguous()
            yield name, QuantTensor(qtype, data, (shape[0], shape[1]))
            continue
        tensor = dequantize_tensor(t)
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        yield name, tensor


def _split_experts(t: GGUFTensorInfo, name: str, shape: tuple[int, ...],
                   keep: Callable[[str, str], bool] | None) -> Iterator[tuple[str, Any]]:
    """A 3-D tensor stacks a layer's experts ([n_expert, out, in]): yield each expert's matrix under its
    checkpoint name, the expert index inserted before the projection (``...experts.w1.weight`` ->
    ``...experts.3.w1.weight``). Blocks run along rows, so each expert's rows are whole blocks, kept as
    they are where ``keep`` says so."""
    from tideserve.model.layers.quant.weights import QuantTensor

    stem, leaf, param = name.rsplit(".", 2)
    n_expert, out, cols = shape
    qtype = gguf_qtype(t)
    names = [f"{stem}.{e}.{leaf}.{param}" for e in range(n_expert)]
    if keep is not None and keep(names[0], qtype):
        data = read_blocks(t)
        for e, expert in enumerate(names):
            yield expert, QuantTensor(qtype, data[e * out:(e + 1) * out], (out, cols))
        return
    tensor = dequantize_tensor(t)
    for e, expert in enumerate(names):
        yield expert, tensor[e]


def quantized_share(index: GGUFIndex, qtypes: Iterable[str]) -> float:
    """The share of the file's matrix bytes (2-D tensors and 3-D stacked experts) stored in one of ``qtypes``."""
    wanted = set(qtypes)
    total = kept = 0
    for t in index.tensors:
        if len(t.shape) in (2, 3):
            total += t.n_bytes
            kept += t.n_bytes if gguf_qtype(t) in wanted else 0
    return kept / total if total else 0.0


def load_gguf(path: str, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
              ) -> tuple[torch.nn.Module, ArchConfig]:
    """Build the model for a GGUF file and load its weights: dequantized to ``dtype`` (quantization
    "none"), or kept as blocks ("gguf": every tensor whose format has a kernel stays as it is, the rest
    becomes q8_0; "int4": Q4_0/Q4_1/Q4_K blocks stay, other projections become q4_1 and other tables
    q8_0), one tensor at a time."""
    from tideserve.model.layers.quant.blocks import quantize_blocks
    from tideserve.native.quant import QTYPES

    index = read_gguf_index(path)
    parts = int(index.get("split.count", 1))
    if parts > 1:  # llama.cpp's gguf-split: each part holds some of the tensors
        raise ValueError(f"{path} is part {int(index.get('split.no', 0)) + 1} of a GGUF split into {parts} files; "
                         "merge them into one file first (llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
    arch = ArchConfig.from_gguf_metadata(index)
    types = sorted({t.tensor_type.name for t in index.tensors})
    logger.info("GGUF %s: %s, %d layers, tensor types %s", path, arch.architecture, arch.num_hidden_layers,
                ",".join(types))
    model = resolve_model_class(arch.architecture)(arch, dtype=dtype, device=device)
    keep = None
    if quantization in ("gguf", "int4"):
        four_bit = {"q4_0", "q4_1", "q4_k"}
        linear_qtype = "q8_0" if quantization == "gguf" else "q4_1"

        def keep(name: str, qtype: str) -> bool:
            if quantization == "gguf" or name.endswith(("embed_tokens.weight", "lm_head.weight")):
                return qtype in QTYPES
            return qtype in four_bit

        model.begin_quantized_load(lambda w: (linear_qtype, quantize_blocks(w, linear_qtype)),
                                   lambda w: ("q8_0", quantize_blocks(w, "q8_0")))
    model.load_weights(iter_gguf_weights(index, arch, keep))
    return model.eval(), arch
