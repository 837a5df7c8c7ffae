"""The Triton paged prefill kernel against a plain torch reference (blocks gathered, causal softmax in
float32): fresh prompts, chunks after a cached prefix (prefix hits, chunked prefill), single-token and
empty queries, grouped-query attention, float32/bfloat16/float16 and mixed caches, block sizes 16 and 32;
sliding windows (one key, a few, more than the context, starting inside a cached prefix) and soft-capped
scores, in the torch backend's semantics."""

from __future__ import annotations

import pytest
import torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = {  # name: (query_lens, context_lens, the cache's Shape)
    "fp32-mha-d64-b16-fresh": ([1, 20, 70], [1, 20, 70], dict(num_heads=2, num_kv_heads=2, head_dim=64,
                                                              block_size=16, q_dtype=F32, kv_dtype=F32)),
    "bf16-gqa4-d32-b32-prefix": ([10, 1, 64], [100, 33, 104], dict(num_heads=8, num_kv_heads=2, head_dim=32,
                                                                   block_size=32, q_dtype=BF16, kv_dtype=BF16)),
    "fp16-gqa2-d16-b16-mixed": ([5, 0, 17, 1], [5, 40, 150, 1], dict(num_heads=4, num_kv_heads=2, head_dim=16,
                                                                     block_size=16, q_dtype=F16, kv_dtype=F16)),
    "fp32q-bf16kv-gqa3-d64-b32-int64-strided": (
        [7, 30], [57, 30], dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=32, q_dtype=F32,
                                kv_dtype=BF16, index_dtype=torch.int64, strided=True)),
}


WINDOW_CASES = {  # name: (query_lens, context_lens, window, softcap, the cache's Shape)
    "fp32-gqa2-window1": ([1, 20, 70], [1, 20, 70], 1, 0.0, dict(num_heads=4, num_kv_heads=2, head_dim=16,
                                                                 block_size=16, q_dtype=F32, kv_dtype=F32)),
    # Chunks after a cached prefix: the windows of their first queries start inside the prefix.
    "fp32-gqa3-window8-softcap-prefix": ([10, 1, 30], [50, 33, 100], 8, 0.4, dict(
        num_heads=6, num_kv_heads=2, head_dim=16, block_size=16, q_dtype=F32, kv_dtype=F32)),
    "fp32-mha-window3-fresh": ([25, 4], [25, 4], 3, 0.0, dict(num_heads=2, num_kv_heads=2, head_dim=32,
                                                              block_size=16, q_dtype=F32, kv_dtype=F32)),
    "fp16-gqa2-window-past-context-softcap": ([5, 17], [5, 150], 1000, 0.5, dict(
        num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, q_dtype=F16, kv_dtype=F16)),
    # BLOCK_Q is 32 rows here: the second query tile's window starts past the first key tile.
    "bf16-gqa2-window20-b32-prefix": ([70], [140], 20, 0.0, dict(num_heads=4, num_kv_heads=2, head_dim=32,
                                                                  block_size=32, q_dtype=BF16, kv_dtype=BF16)),
}


def reference_prefill(kv, query_start_loc: list[int], window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Each chunk is the last query_len positions of its context: causal within it, full over the prefix
    (or, with ``window``, keys p - window + 1 .. p); scores soft-capped before masking, as in the torch
    backend."""
    out = torch.zeros(kv.q.shape)
    for s in range(len(query_start_loc) - 1):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        if start == end:
            continue
        k, v = kv.keys(s)
        n = k.shape[0]
        scores = torch.einsum("qhd,nhd->hqn", kv.q[start:end].float().cpu(), k) * kv.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(n - (end - start), n)[:, None]
        allowed = torch.arange(n)[None, :] <= pos
        if window:
            allowed &= torch.arange(n)[None, :] > pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
    return out


def _check(triton_attention, paged_kv, close, device, query_lens, contexts, shape, window=0, softcap=0.0):
    kv = paged_kv(contexts, sum(query_lens), device, **shape)
    bounds = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    starts = torch.tensor(bounds, dtype=kv.context_lens.dtype, device=device)
    triton_attention.paged_prefill_attention(kv.q, kv.k_cache, kv.v_cache, kv.block_tables, starts,
                                             kv.context_lens, kv.scale, kv.out, window=window, softcap=softcap)
    ref = reference_prefill(kv, bounds, window, softcap)
    close(kv.out, ref, shape["q_dtype"])
    if softcap or 0 < window < max(contexts):  # the case must tell the feature from its absence
        assert not torch.allclose(ref, reference_prefill(kv, bounds), atol=1e-2)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference(triton_attention, paged_kv, close, device, case):
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, device, *CASES[case])


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_prefill_window_and_softcap_match_reference(triton_attention, paged_kv, close, device, case):
    query_lens, contexts, window, softcap, shape = WINDOW_CASES[case]
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, device, query_lens, contexts, shape, window, softcap)


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
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_prefill_llama_shapes_on_cuda(triton_attention, paged_kv, close, cuda_device, dtype):
    """Llama-8B-like heads in half precision: a long fresh prompt, chunks after long prefixes, one token."""
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, cuda_device, [1024, 512, 1, 300], [1024, 2048, 777, 4096],
           dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, q_dtype=dtype, kv_dtype=dtype))
