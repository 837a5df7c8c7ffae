"""The Triton paged prefill kernel against a plain torch reference (blocks gathered, causal softmax in
float32): fresh prompts, chunks after a cached prefix (prefix hits, chunked prefill), single-token and
empty queries, grouped-query attention, float32/bfloat16/float16 and mixed caches, block sizes 16 and 32."""

from __future__ import annotations

import pytest
import torch

CASES = {
    # name: (query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, q dtype, cache dtype,
    #        index dtype)
    "fp32-mha-d64-b16-fresh": ([1, 20, 70], [1, 20, 70], 2, 2, 64, 16, torch.float32, torch.float32, torch.int32),
    "bf16-gqa4-d32-b32-prefix": ([10, 1, 64], [100, 33, 104], 8, 2, 32, 32, torch.bfloat16, torch.bfloat16,
                                 torch.int32),
    "fp16-gqa2-d16-b16-mixed": ([5, 0, 17, 1], [5, 40, 150, 1], 4, 2, 16, 16, torch.float16, torch.float16,
                                torch.int32),
    "fp32q-bf16kv-gqa3-d64-b32-int64": ([7, 30], [57, 30], 9, 3, 64, 32, torch.float32, torch.bfloat16,
                                        torch.int64),
}


def reference_prefill(q: torch.Tensor, kv, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Each chunk is the last query_len positions of its context: causal within it, full over the prefix."""
    out = torch.zeros(q.shape)
    bounds = query_start_loc.tolist()
    for s in range(len(bounds) - 1):
        start, end = bounds[s], bounds[s + 1]
        if start == end:
            continue
        k, v = (t.cpu() for t in kv.keys(s))
        n, group = k.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,nhd->hqn", q[start:end].float().cpu(), k) * scale
        allowed = torch.arange(n)[None, :] <= torch.arange(n - (end - start), n)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
    return out


def _run(triton_attention, paged_kv, close, device, query_lens, contexts, num_heads, num_kv_heads, head_dim,
         block_size, q_dtype, kv_dtype, index_dtype, strided=False):
    kv = paged_kv(contexts, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  dtype=kv_dtype, device=device, index_dtype=index_dtype)
    tokens = sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=index_dtype, device=device)
    if strided:  # q and out as row slices of wider (fused-QKV-like) tensors
        q = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim).to(q_dtype).to(device)[:, :num_heads]
        out = torch.zeros(tokens, num_heads + 1, head_dim, dtype=q_dtype, device=device)[:, 1:]
    else:
        q = torch.randn(tokens, num_heads, head_dim).to(q_dtype).to(device)
        out = torch.zeros(tokens, num_heads, head_dim, dtype=q_dtype, device=device)
    scale = head_dim ** -0.5
    triton_attention.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.context_lens,
                                             scale, out)
    close(out, reference_prefill(q, kv, starts.cpu(), scale), q_dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference(triton_attention, paged_kv, close, device, case):
    torch.manual_seed(0)
    _run(triton_attention, paged_kv, close, device, *CASES[case], strided=case.startswith("fp32q"))


def test_prefill_rejects_wrong_inputs(triton_attention):
    f = triton_attention.paged_prefill_attention
    cache = torch.zeros(4, 16, 2, 16)
    q = torch.zeros(5, 4, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="one more entry than context_lens"):
        f(q, cache, cache, tables, torch.tensor([0, 5], dtype=torch.int32), lens, 1.0, torch.zeros_like(q))
    with pytest.raises(ValueError, match="head_dim 32 differs from q's head_dim 16"):
        f(q, torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32), tables,
          torch.tensor([0, 3, 5], dtype=torch.int32), lens, 1.0, torch.zeros_like(q))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_llama_shapes_on_cuda(triton_attention, paged_kv, close, cuda_device, dtype):
    """Llama-8B-like heads in half precision: a long fresh prompt, chunks after long prefixes, one token."""
    torch.manual_seed(0)
    _run(triton_attention, paged_kv, close, cuda_device, [1024, 512, 1, 300], [1024, 2048, 777, 4096],
         32, 8, 128, 16, dtype, dtype, torch.int32)
