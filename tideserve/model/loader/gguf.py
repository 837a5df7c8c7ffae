"""GGUF checkpoints: metadata -> ArchConfig, tensors renamed to HF names and dequantized to float32, or
kept as the file's own blocks for the quantized kernels (``--quantization gguf``, the default for
quantized files).

llama.cpp's converter permutes the rows of Q and K for llama-arch models (to its interleaved rotary
layout); our rotary is HF's rotate-half layout, so those rows are permuted back here. Qwen2 files are
converted without the permutation and are left as they are.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gguf
import numpy as np
import torch

from tideserve.model.arch_config import ArchConfig, gguf_metadata_value
from tideserve.model.registry import resolve_model_class

logger = logging.getLogger(__name__)

# GGUF architectures whose attn_q / attn_k rows llama.cpp permutes at conversion time
_PERMUTED_ARCHS = frozenset({"llama", "mistral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tensors that are not weights of a module (rope_freqs is read into ArchConfig.rope_scaling)
_SKIPPED = frozenset({"rope_freqs.weight"})


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF Llama checkpoint name; unknown names raise ValueError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not a known Llama-family tensor")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows (head, half, i) were stored as (head, i, half)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def dequantize_tensor(t: gguf.ReaderTensor) -> torch.Tensor:
    """Any type the gguf package can dequantize -> float32 tensor in row-major (HF) shape [out, in]."""
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # memory-mapped F32 data
        arr = arr.copy()
    return torch.from_numpy(arr)


def read_blocks(path: str, t: gguf.ReaderTensor) -> torch.Tensor:
    """A quantized tensor's bytes, uint8 [rows, row_bytes], read from the file into memory we own: not
    through the reader's memory map, whose pages would count as ours until it closes."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    out = torch.empty(rows, int(t.n_bytes) // max(rows, 1), dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(int(t.data_offset))
        view = memoryview(out.numpy()).cast("B")
        while view:
            got = f.readinto(view)
            if not got:
                raise ValueError(f"GGUF tensor {t.name!r} is cut short in {path}")
            view = view[got:]
    return out


def gguf_qtype(t: gguf.ReaderTensor) -> str:
    """The tensor type's name as native.quant.QTYPES spells it ("q4_k", "f32", ...)."""
    return t.tensor_type.name.lower()


def iter_gguf_weights(reader: gguf.GGUFReader, arch: ArchConfig, path: str | None = None,
                      keep: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, tensor) one at a time, so peak memory stays about one tensor above the model.

    Tensors are float32, except where ``keep(hf name, qtype)`` is true: those come as QuantTensor, the
    file's own blocks (read from ``path``), with llama's q/k rows put back in HF order all the same.
    """
    from tideserve.model.layers.quantization import QuantTensor

    gguf_arch = str(gguf_metadata_value(reader, "general.architecture"))
    permuted = gguf_arch in _PERMUTED_ARCHS
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        qtype = gguf_qtype(t)
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = None
        if permuted and (".q_proj." in name or ".k_proj." in name) and len(shape) == 2:
            heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
        if keep is not None and path is not None and len(shape) == 2 and keep(name, qtype):
            data = read_blocks(path, t)
            if heads is not None:  # whole rows move, so blocks survive the permutation as they are
                data = unpermute_qk(data, heads).contiguous()
            yield name, QuantTensor(qtype, data, (shape[0], shape[1]))
            continue
        tensor = dequantize_tensor(t)
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        yield name, tensor


def quantized_share(reader: gguf.GGUFReader, qtypes: Iterable[str]) -> float:
    """The share of the file's 2-D tensor bytes stored in one of ``qtypes``."""
    wanted = set(qtypes)
    total = kept = 0
    for t in reader.tensors:
        if len(t.shape) == 2:
            total += int(t.n_bytes)
            kept += int(t.n_bytes) if gguf_qtype(t) in wanted else 0
    return kept / total if total else 0.0


def load_gguf(path: str, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
              ) -> tuple[torch.nn.Module, ArchConfig]:
    """Build the model for a GGUF file and load its weights: dequantized to ``dtype`` (quantization
    "none"), or kept as blocks ("gguf": every tensor whose format has a kernel stays as it is, the rest
    becomes q8_0; "int4": Q4_0/Q4_1/Q4_K blocks stay, other projections become q4_1 and other tables
    q8_0), one tensor at a time."""
    from tideserve.model.layers.quantization import quantize_blocks
    from tideserve.native.quant import QTYPES

    reader = gguf.GGUFReader(path)
    arch = ArchConfig.from_gguf_metadata(reader)
    types = sorted({t.tensor_type.name for t in reader.tensors})
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
    model.load_weights(iter_gguf_weights(reader, arch, path, keep))
    return model.eval(), arch
