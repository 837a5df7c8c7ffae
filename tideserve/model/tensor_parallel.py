"""Split a loaded Llama-family model across tensor-parallel ranks (Megatron-style, as vLLM does).

Per decoder layer: the fused q|k|v projection keeps the rows of the rank's attention heads and of the KV
heads they read (column parallel); o_proj keeps the matching input columns and all-reduces its partial
sums (row parallel); gate|up keep the rank's slice of the MLP, down_proj its columns and all-reduces. So a
layer costs two all-reduces and attention runs over the rank's heads only, reading the rank's shard of
every KV block. The vocabulary is split too (model/layers/vocab_parallel_embedding.py).

A mixture-of-experts layer (model/moe.py) splits every expert as the dense MLP is split (each rank keeps
every expert's slice of the expert MLP size) and keeps the router whole, so every rank routes each token
to the same experts; the experts' partial sums are added up first and all-reduced once per layer.

KV heads: each rank keeps whole KV groups (a KV head and the query heads that read it), as evenly as the
count allows: 8 KV heads on 2 ranks are 4 + 4; 3 KV heads (SmolLM2-135M: 9 query heads) are 2 + 1, so
rank 0 computes 6 of the 9 heads' attention and holds twice rank 1's KV bytes per block (vLLM refuses
such counts; here they run, unevenly). With fewer KV heads than ranks, each rank keeps the one KV head its
query heads read (replicated on ``world / num_kv_heads`` ranks). The MLP and the vocabulary split as
evenly as their sizes allow.

Only float weights split here: GGUF blocks, int8 and int4 layers are refused before any process starts
(``check_tensor_parallel``), with the settings that work.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace

import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.layers.linear import CollectiveGroup, ColumnParallelLinear, RowParallelLinear, input_slice
from tideserve.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tideserve.model.moe import SparseMoeBlock


@dataclass(frozen=True)
class HeadShard:
    """The attention heads and KV heads one rank computes."""

    q_heads: range
    kv_heads: range

    def rows(self, heads: range, head_dim: int) -> torch.Tensor:
        return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _split(n: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous part of ``n`` items split as evenly as possible (the first ``n % world``
    ranks take one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def head_shard(arch: ArchConfig, rank: int, world_size: int) -> HeadShard:
    """Whole KV groups per rank (a KV head and the query heads that read it), so attention on every rank
    is ordinary GQA over its own heads. With fewer KV heads than ranks, each rank takes an equal share of
    one group's query heads and that group's KV head (replicated)."""
    nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
    group = nh // nkv  # query heads per KV head
    if nkv >= world_size:
        kv = _split(nkv, rank, world_size)
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    q = _split(nh, rank, world_size)
    kv = q.start // group
    return HeadShard(q, range(kv, kv + 1))


def check_tensor_parallel(arch: ArchConfig, world_size: int, quantization: str) -> None:
    """ValueError naming tensor_parallel_size when the model cannot be split ``world_size`` ways."""
    if world_size == 1:
        return
    tp = f"tensor_parallel_size={world_size}"
    if quantization not in ("none", "auto"):
        raise ValueError(
            f"{tp} needs float weights, but quantization={quantization!r}: tideserve splits float layers across "
            "ranks only (GGUF blocks, int8 and int4 layers are not split). Use quantization='none' "
            "(--quantization none, which dequantizes a GGUF file) with dtype='float32' or 'bfloat16', or "
            "tensor_parallel_size=1 to keep the quantized weights.")
    nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
    if nkv < world_size and (world_size % nkv or (nh // nkv) % (world_size // nkv)):
        raise ValueError(
            f"{tp} cannot split the model's {nkv} KV heads ({nh} attention heads): with fewer KV heads than "
            f"ranks, the ranks must be a multiple of the KV heads whose query heads split evenly among them; "
            f"use a tensor_parallel_size of at most {nkv}.")
    if arch.intermediate_size < world_size or arch.vocab_size < world_size:
        raise ValueError(f"{tp} is larger than the model's MLP size ({arch.intermediate_size}) or vocabulary.")
    if arch.num_experts and arch.moe_intermediate_size < world_size:
        raise ValueError(f"{tp} is larger than the model's expert MLP size ({arch.moe_intermediate_size}).")


def shard_model(model: torch.nn.Module, group: CollectiveGroup) -> torch.nn.Module:
    """This rank's part of ``model`` as a new module; ``model`` is left untouched (several engines may share
    it), and only the rank's slices are copied."""
    arch: ArchConfig = model.arch
    if getattr(model, "lm_head_q", None) is not None or model.model.embed_tokens.weight is None:
        raise ValueError("a quantized model cannot be split across tensor-parallel ranks")
    # A structural copy that shares every tensor; each split below replaces tensors, never writes them.
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    part = copy.deepcopy(model, memo=shared)
    world, rank, hd = group.world_size, group.rank, arch.head_dim
    heads = head_shard(arch, rank, world)
    q_rows, kv_rows = heads.rows(heads.q_heads, hd), heads.rows(heads.kv_heads, hd)
    mlp = _split(arch.intermediate_size, rank, world)
    mlp_rows, mlp_size = torch.arange(mlp.start, mlp.stop), len(mlp)
    expert = _split(arch.moe_intermediate_size, rank, world)
    expert_rows, expert_size = torch.arange(expert.start, expert.stop), len(expert)
    for layer in part.model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear.shard(attn.qkv_proj, {"q": q_rows, "k": kv_rows, "v": kv_rows})
        attn.o_proj = RowParallelLinear.shard(attn.o_proj, q_rows, group)
        attn.num_heads, attn.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
        attn.q_size, attn.kv_size = len(q_rows), len(kv_rows)
        if isinstance(layer.mlp, SparseMoeBlock):
            for e in layer.mlp.experts:
                e.gate_up_proj = ColumnParallelLinear.shard(e.gate_up_proj, {"gate": expert_rows, "up": expert_rows})
                e.down_proj = input_slice(e.down_proj, expert_rows)
                e.intermediate_size = expert_size
            layer.mlp.group = group
            continue
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear.shard(mlp.gate_up_proj, {"gate": mlp_rows, "up": mlp_rows})
        mlp.down_proj = RowParallelLinear.shard(mlp.down_proj, mlp_rows, group)
        mlp.intermediate_size = mlp_size
    embed = VocabParallelEmbedding(model.model.embed_tokens.weight, group)
    part.model.embed_tokens = embed
    head = embed if arch.tie_word_embeddings else VocabParallelEmbedding(model.lm_head.weight, group)
    part.lm_head = head
    part.parallel_lm_head = ParallelLMHead(head)
    part.native_decode = None
    # The part's own shape: what the attention backend binds its kernels to, and the profiling estimate
    part.arch = replace(arch, num_attention_heads=len(heads.q_heads), num_key_value_heads=len(heads.kv_heads),
                        intermediate_size=mlp_size, moe_intermediate_size=expert_size)
    return part
