"""The Triton paged decode kernel against a plain torch reference (blocks gathered, softmax in float32):
grouped-query attention, float32/bfloat16/float16 and mixed caches, block sizes 16 and 32, contexts from
one token to many blocks, split-K by the default rule and forced, padded table entries never read."""

from __future__ import annotations

import pytest
import torch

CASES = {
    # name: (context_lens, num_heads, num_kv_heads, head_dim, block_size, q dtype, cache dtype, index dtype,
    #        partition_size)
    "fp32-mha-d64-b16": ([1, 17, 100], 2, 2, 64, 16, torch.float32, torch.float32, torch.int32, None),
    "bf16-gqa4-d32-b32-rule-split": ([700, 3, 129], 8, 2, 32, 32, torch.bfloat16, torch.bfloat16, torch.int32,
                                     None),
    "fp16-gqa2-d16-b16-split64": ([130, 5, 64, 300], 4, 2, 16, 16, torch.float16, torch.float16, torch.int32, 64),
    "fp32q-bf16kv-gqa3-d64-b32-int64-split128": ([33, 250], 9, 3, 64, 32, torch.float32, torch.bfloat16,
                                                 torch.int64, 128),
}


def reference_decode(q: torch.Tensor, kv, scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    out = torch.empty(batch, num_heads, head_dim)
    for b in range(batch):
        k, v = (t.cpu() for t in kv.keys(b))
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float().cpu(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def _run(triton_attention, paged_kv, close, device, contexts, num_heads, num_kv_heads, head_dim, block_size,
         q_dtype, kv_dtype, index_dtype, partition_size, strided=False):
    kv = paged_kv(contexts, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  dtype=kv_dtype, device=device, index_dtype=index_dtype)
    batch = len(contexts)
    if strided:  # q and out as row slices of wider (fused-QKV-like) tensors
        q = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim).to(q_dtype).to(device)[:, :num_heads]
        out = torch.zeros(batch, num_heads + 1, head_dim, dtype=q_dtype, device=device)[:, 1:]
    else:
        q = torch.randn(batch, num_heads, head_dim).to(q_dtype).to(device)
        out = torch.zeros(batch, num_heads, head_dim, dtype=q_dtype, device=device)
    scale = head_dim ** -0.5
    triton_attention.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale,
                                            out, partition_size=partition_size)
    close(out, reference_decode(q, kv, scale), q_dtype)  # float32 q: computed in float32 whatever the cache


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_reference(triton_attention, paged_kv, close, device, case):
    torch.manual_seed(0)
    _run(triton_attention, paged_kv, close, device, *CASES[case], strided=case.startswith("fp32q"))


def test_split_rule(triton_attention):
    """One partition per 512 tokens, split only when the batch alone leaves the GPU idle or the context
    is very long."""
    n = triton_attention.num_partitions
    assert n(512, 4) == 1
    assert n(513, 4) == 2
    assert n(700, 6) == 2  # the rule-split case above
    assert n(4096, 1024) == 1
    assert n(10_000, 1024) == 20


def test_decode_rejects_wrong_inputs(triton_attention):
    f = triton_attention.paged_decode_attention
    cache = torch.zeros(4, 16, 4, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of the cache's num_kv_heads 4"):
        f(torch.zeros(2, 6, 16), cache, cache, tables, lens, 1.0, torch.zeros(2, 6, 16))
    with pytest.raises(ValueError, match="partition_size must be a positive multiple of 64, got 100"):
        f(torch.zeros(2, 8, 16), cache, cache, tables, lens, 1.0, torch.zeros(2, 8, 16), partition_size=100)
    with pytest.raises(ValueError, match="batch size 3"):
        f(torch.zeros(3, 8, 16), cache, cache, tables, lens, 1.0, torch.zeros(3, 8, 16))
    with pytest.raises(ValueError, match="block_tables must be a 2-d int32"):
        f(torch.zeros(2, 8, 16), cache, cache, tables.float(), lens, 1.0, torch.zeros(2, 8, 16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("contexts", [[1, 15, 16, 17, 300, 1000, 2047, 4096] * 2, [20_000, 9000]],
                         ids=["batch16-to4k", "batch2-long"])
def test_decode_llama_shapes_on_cuda(triton_attention, paged_kv, close, cuda_device, dtype, contexts):
    """Llama-8B-like heads (32 query, 8 KV, head_dim 128) in half precision, the half-precision dot on
    tensor cores that the interpreter cannot run."""
    torch.manual_seed(0)
    _run(triton_attention, paged_kv, close, cuda_device, contexts, 32, 8, 128, 16, dtype, dtype, torch.int32, None)
