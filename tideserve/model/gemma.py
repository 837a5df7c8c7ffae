"""Gemma 2 and Gemma 3 (text) decoders over a flat, unpadded token batch, on the Llama class's loading,
quantization and LM-head machinery (``LlamaForCausalLM``), with Gemma's own layers:

- RMSNorm multiplying by (offset + w) in float32 (``ArchConfig.norm_weight_offset``: 1 for HF checkpoints,
  0 for GGUF files, whose converter added the 1), four per layer, each sub-block normed before and after;
- a GeGLU MLP (gelu, tanh approximation), embeddings scaled by sqrt(hidden_size) in the model's dtype;
- per layer, a sliding window (``ArchConfig.layer_window``) and a rotary table: the sliding layers of Gemma
  3 use their own unscaled base (``rope_local_theta``);
- attention scale ``query_pre_attn_scalar ** -0.5``, soft-capped scores (Gemma 2) and logits.

The attention backend applies the window and the soft-cap (``AttentionBackend.forward``). With local and
global layers the KV cache keeps them in separate groups (core/kv_cache/groups.py): a local layer's group
holds only the blocks of its window, and each layer attends with its group's metadata (``GroupedMetadata``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tideserve.model.arch_config import ArchConfig
from tideserve.model.attention import AttentionMetadata, GroupedMetadata, metadata_per_layer
from tideserve.model.layers.linear import Linear
from tideserve.model.layers.norm import RMSNorm
from tideserve.model.layers.rotary import RotaryEmbedding
from tideserve.model.llama import Embedding, KVCache, LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (offset + w), all in float32, rounded to x's dtype once (as transformers' Gemma norms).

    A subclass of ``RMSNorm`` so the loader treats its weight as a norm's; the native norm kernels, which
    multiply by w in the model's dtype, are not used.
    """

    def __init__(self, hidden_size: int, eps: float, offset: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(hidden_size, eps, dtype, device)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (self.offset + self.weight.float())).to(x.dtype)

    def forward_heads_(self, x: torch.Tensor) -> None:
        """Each head of x [T, heads * head_dim] normalised in place (x: columns of the fused qkv output)."""
        heads = x.unflatten(-1, (-1, self.normalized_shape[0]))
        heads.copy_(self(heads))


class GemmaAttention(LlamaAttention):
    """Llama's attention (the layer's window included) with Gemma's scale (``query_pre_attn_scalar``),
    score soft-cap and (offset + w) q/k norms."""

    def __init__(self, arch: ArchConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(arch, dtype, device, layer)
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.softcap = arch.attn_logit_softcapping or 0.0
        if arch.qk_norm:
            offset = arch.norm_weight_offset
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, offset, dtype, device)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, offset, dtype, device)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with gate and up as one matmul."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, {"gate": size, "up": size}, bias=False, dtype=dtype,
                                   device=device)
        self.down_proj = Linear(size, arch.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.down_proj.in_features, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """h += post_attn_norm(attn(input_norm(h))); h += post_ffn_norm(mlp(pre_ffn_norm(h)))."""

    def __init__(self, arch: ArchConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset, dtype, device)

        self.sliding = bool(arch.layer_window(layer))
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(arch, layer, dtype, device)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(arch, dtype, device)
        self.post_feedforward_layernorm = norm()

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(arch, i, dtype, device) for i in range(arch.num_hidden_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset, dtype, device)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text, with ``LlamaForCausalLM``'s contract (``forward`` -> final-normed hidden
    states, ``compute_logits`` -> float32 logits) and its weight loading; decode steps always take the
    Python path (the native decode step implements Llama's layers only)."""

    native_decode_layers = False

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.dtype = dtype
        self.model = GemmaModel(arch, dtype, device)
        positions = max_positions or arch.max_position_embeddings
        self.rotary = RotaryEmbedding(arch.head_dim, positions, arch.rope_theta, arch.rope_scaling, dtype, device)
        self.rotary_local: RotaryEmbedding | None = None
        if arch.rope_local_theta is not None and any(layer.sliding for layer in self.model.layers):
            self.rotary_local = RotaryEmbedding(arch.head_dim, positions, arch.rope_local_theta, None, dtype, device)
        # transformers multiplies by sqrt(hidden_size) rounded to the model's dtype
        self.embed_scale = float(torch.tensor(math.sqrt(arch.hidden_size)).to(dtype))
        self.lm_head = (self.model.embed_tokens if arch.tie_word_embeddings
                        else Embedding(arch.vocab_size, arch.hidden_size, dtype, device))
        self.lm_head_q = None
        self.parallel_lm_head = None
        self.native_decode = None
        self._quantize_table = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | GroupedMetadata) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embed_scale
        cos, sin = self.rotary.cos_sin(positions)
        local = self.rotary_local.cos_sin(positions) if self.rotary_local is not None else (cos, sin)
        metas = metadata_per_layer(meta, len(self.model.layers))
        for layer, kv_cache, layer_meta in zip(self.model.layers, kv_caches, metas, strict=True):
            h = layer(h, *(local if layer.sliding else (cos, sin)), kv_cache, layer_meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, soft-capped (c * tanh(logits / c)) where the model caps them."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def enable_native_decode(self) -> bool:
        """Never: the native decode step (decode_forward.c) runs Llama's layers, not Gemma's."""
        self.native_decode = None
        return False
