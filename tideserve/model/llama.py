"""Llama-family decoder (Llama 2/3, Mistral, SmolLM/SmolLM2, Qwen2, Qwen3, Phi-3/Phi-4; with a
mixture-of-experts MLP, Mixtral and Qwen3-MoE: model/moe.py) over a flat, unpadded token batch.

The model knows nothing of requests: it sees token ids, their positions, one (k_cache, v_cache) pair per
layer and an ``AttentionMetadata``. Module names mirror HF checkpoints (``model.layers.N.self_attn...``),
except that q/k/v and gate/up are fused; ``load_weights`` maps checkpoint names onto the fused rows, and
splits checkpoints that store them fused already (Phi-3's ``qkv_proj`` and ``gate_up_proj``) by shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tideserve.model.arch_config import ArchConfig
from tideserve.model.attention import AttentionMetadata
from tideserve.model.layers.linear import Linear
from tideserve.model.layers.norm import RMSNorm
from tideserve.model.layers.rotary import RotaryEmbedding, apply_rotary_
from tideserve.model.moe import Router, SparseMoeBlock, checkpoint_tensors

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint module suffix -> (our fused module suffix, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LlamaAttention(nn.Module):
    """Fused qkv projection, in-place rotary on the q|k rows, paged attention, output projection.

    With ``arch.qk_norm`` (Qwen3), ``q_norm`` and ``k_norm`` normalise each q and k head in place between
    the projection and rotary; their weights are [head_dim], the same for every head, so a tensor-parallel
    rank keeps them whole whichever heads it computes.
    """

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.scale = arch.head_dim ** -0.5
        self.window = arch.layer_window(layer)  # keys a query attends (0: all); Phi-3's and Gemma's windows
        self.softcap = 0.0  # the scores' soft-cap (0: none): Gemma 2 sets it
        self.qkv_proj = Linear(arch.hidden_size, {"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size},
                               bias=arch.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = h.shape[0]
        qkv = self.qkv_proj(h)
        if self.q_norm is not None:
            self.q_norm.forward_heads_(qkv[:, : self.q_size])
            self.k_norm.forward_heads_(qkv[:, self.q_size: self.q_size + self.kv_size])
        backend = meta.backend
        # A backend's kernel may rotate q|k and store k, v in the cache in one pass (bound at its
        # construction for the model's dtype); else torch rotates and the backend stores.
        rope_store = backend.rope_store
        if rope_store is not None:
            rope_store(qkv, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1])
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                      self.head_dim)
        if rope_store is None:
            apply_rotary_(qk, cos, sin)  # q and k in one pass
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, rope_store is not None,
                              window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one matmul; ``intermediate_size`` defaults to the
    arch's (a mixture of experts builds its experts with theirs)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or arch.intermediate_size
        self.intermediate_size = size
        self.gate_up_proj = Linear(arch.hidden_size, {"gate": size, "up": size}, bias=False, dtype=dtype,
                                   device=device)
        self.down_proj = Linear(size, arch.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_swiglu(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm also does the residual add.
    Layer ``index``'s MLP is a mixture of experts where ``arch.is_moe_layer(index)``."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(arch, dtype, device, index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp: nn.Module
        if arch.is_moe_layer(index):
            experts = (LlamaMLP(arch, dtype, device, arch.moe_intermediate_size) for _ in range(arch.num_experts))
            self.mlp = SparseMoeBlock(arch, experts, dtype, device)
        else:
            self.mlp = LlamaMLP(arch, dtype, device)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Embedding(nn.Module):
    """Token embedding table without nn.Embedding's random init (weights always come from a checkpoint).

    A quantized load keeps the table as GGUF blocks (``qweight``) and dequantizes only the rows a step
    looks up; a tied LM head multiplies by the same blocks.
    """

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.qweight: Any = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.embed(input_ids)  # float32, the dtype of quantized models
        return F.embedding(input_ids, self.weight)


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, device, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The model runner's contract: ``forward`` -> final-normed hidden states [T, hidden];
    ``compute_logits`` -> float32 logits for the rows the runner picks (usually each request's last).

    Parameters never require grad, so no autograd graph is built; callers may still wrap a step in
    ``torch.inference_mode()`` to skip version-counter bookkeeping.
    """

    # The native decode step computes these layers exactly; a subclass whose layers differ sets False.
    native_decode_layers: bool = True

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.model = LlamaModel(arch, dtype, device)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions or arch.max_position_embeddings,
                                      arch.rope_theta, arch.rope_scaling, dtype, device, arch.rotary_dim)
        self.lm_head = (self.model.embed_tokens if arch.tie_word_embeddings
                        else Embedding(arch.vocab_size, arch.hidden_size, dtype, device))
        self.lm_head_q = None  # a quantized copy of the LM head under --quantization int8/int4
        self.parallel_lm_head: Any = None  # this rank's vocabulary slice, all-gathered (model/tensor_parallel.py)
        # Every decoder layer of a decode-only step in one native call (model/native_decode.py); set by
        # enable_native_decode once the layers are block-quantized.
        self.native_decode: Any = None
        self._quantize_table: Callable[[torch.Tensor], tuple[str, torch.Tensor]] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches[i]: layer i's (k, v), each
        [num_blocks, block_size, num_kv_heads, head_dim]. Positions must be < ``rotary.max_positions``."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        if self.native_decode is not None and self.native_decode(h, cos, sin, kv_caches, meta):
            return h
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        if self.parallel_lm_head is not None:
            return self.parallel_lm_head(hidden)
        if self.lm_head_q is not None:
            return self.lm_head_q(hidden).float()
        return F.linear(hidden, self.lm_head.weight).float()

    def enable_native_decode(self) -> bool:
        """Run decode-only steps through one native call when the layers allow it; returns whether they do."""
        from tideserve.model.native_decode import NativeDecodeForward

        self.native_decode = NativeDecodeForward.build(self)
        return self.native_decode is not None

    def quantize_lm_head(self, quantize: Callable[[torch.Tensor], Any]) -> int:
        """A quantized LM head, ``quantize(weight)`` (see layers/quant/); returns the bytes saved
        (negative when tied: the float table stays for embedding lookups)."""
        weight = self.lm_head.weight
        self.lm_head_q = quantize(weight)
        if self.arch.tie_word_embeddings:
            return -self.lm_head_q.nbytes
        self.lm_head.weight = None
        return weight.numel() * weight.element_size() - self.lm_head_q.nbytes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors, named as in HF Llama (or Phi-3: fused) checkpoints, into the fused parameters.

        Every parameter, and every shard of a fused one, must be loaded exactly as the model expects;
        anything missing, unknown or of the wrong shape raises ValueError naming it.
        """
        from tideserve.model.layers.quant.blocks import dequantize_blocks
        from tideserve.model.layers.quant.weights import QuantTensor, QuantWeight

        if self.arch.num_experts:
            weights = checkpoint_tensors(weights)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            shard_id: str | None = None
            if leaf in _STACKED:
                fused, shard_id = _STACKED[leaf]
                module_path = f"{parent}.{fused}"
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model") from None
            shards = [shard_id]
            if isinstance(module, Linear):
                try:
                    if shard_id is None and None not in module.shard_offsets:  # stored fused (Phi-3)
                        shards = module.load_fused(param_name, tensor)
                    else:
                        module.load(param_name, tensor, shard_id)
                except ValueError as exc:
                    raise ValueError(f"{module_path}: {exc}") from None
            elif isinstance(module, Embedding) and (isinstance(tensor, QuantTensor) or self._quantize_table):
                shape = tuple(module.weight.shape)
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                                     f"model's {shape}")
                block = ((tensor.qtype, tensor.data) if isinstance(tensor, QuantTensor)
                         else self._quantize_table(tensor.float()))
                module.qweight = QuantWeight([block], shape[1])
                module.weight = None
            else:
                param = getattr(module, param_name, None)
                if not isinstance(param, nn.Parameter):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")  # noqa: TRY004
                if isinstance(tensor, QuantTensor):  # a MoE router stored in blocks: it stays float
                    tensor = dequantize_blocks(tensor.data, tensor.qtype, tensor.shape[1])
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                                     f"model's {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.update(f"{module_path}.{param_name}" + (f"[{s}]" if s else "") for s in shards)

        missing = sorted(self._expected_weights() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
        if self._quantize_table is not None:  # a quantized load: the LM head multiplies by the table's blocks
            self.lm_head_q = self.lm_head.qweight
            self._quantize_table = None
            self.enable_native_decode()

    def begin_quantized_load(self, linear: Callable[[torch.Tensor], tuple[str, torch.Tensor]],
                             table: Callable[[torch.Tensor], tuple[str, torch.Tensor]]) -> None:
        """Make the next ``load_weights`` keep GGUF blocks (QuantTensor) as they are and quantize float
        tensors one layer at a time: ``linear`` for the projections, ``table`` for the embedding table and
        LM head (each float [rows, in] -> (qtype, uint8 blocks)). The float weights are never written."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_on_load = linear
        self._quantize_table = table

    def _expected_weights(self) -> set[str]:
        expected: set[str] = set()
        for path, module in self.named_modules():
            if isinstance(module, Linear):
                for shard_id in module.shard_offsets:
                    suffix = f"[{shard_id}]" if shard_id else ""
                    expected.add(f"{path}.weight{suffix}")
                    if module.bias is not None:
                        expected.add(f"{path}.bias{suffix}")
            elif isinstance(module, (RMSNorm, Embedding, Router)):
                expected.add(f"{path}.weight")
        return expected
