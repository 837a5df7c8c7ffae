"""GGUF checkpoints: metadata -> ArchConfig, tensors dequantized to float32 and renamed to HF names.

llama.cpp's converter permutes the rows of Q and K for llama-arch models (to its interleaved rotary
layout); our rotary is HF's rotate-half layout, so those rows are permuted back here. Qwen2 files are
converted without the permutation and are left as they are.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

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


def iter_gguf_weights(reader: gguf.GGUFReader, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) one at a time: peak memory stays about one tensor above the model."""
    gguf_arch = str(gguf_metadata_value(reader, "general.architecture"))
    permuted = gguf_arch in _PERMUTED_ARCHS
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        tensor = dequantize_tensor(t)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
            tensor = unpermute_qk(tensor, heads)
        yield name, tensor


def load_gguf(path: str, dtype: torch.dtype, device: torch.device | str
              ) -> tuple[torch.nn.Module, ArchConfig]:
    """Build the model for a GGUF file and load its (dequantized) weights."""
    reader = gguf.GGUFReader(path)
    arch = ArchConfig.from_gguf_metadata(reader)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    logger.info("GGUF %s: %s, %d layers, tensor types %s", path, arch.architecture, arch.num_hidden_layers,
                ",".join(types))
    model = resolve_model_class(arch.architecture)(arch, dtype=dtype, device=device)
    model.load_weights(iter_gguf_weights(reader, arch))
    return model.eval(), arch
