"""The Triton paged decode kernel against a plain torch reference (blocks gathered, softmax in float32):
grouped-query attention, float32/bfloat16/float16 and mixed caches, block sizes 16 and 32, contexts from
one token to many blocks, split-K by the default rule and forced, padded table entries never read; sliding
windows (one key, a few, more than the context; split-K partitions wholly before the window) and soft-capped
scores, in the torch backend's semantics."""

from __future__ import annotations

import pytest
import torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = {  # name: (context_lens, partition_size, the cache's Shape)
    "fp32-mha-d64-b16": ([1, 17, 100], None, dict(num_heads=2, num_kv_heads=2, head_dim=64, block_size=16,
                                                  q_dtype=F32, kv_dtype=F32)),
    "bf16-gqa4-d32-b32-rule-split": ([700, 3, 129], None, dict(num_heads=8, num_kv_heads=2, head_dim=32,
                                                                block_size=32, q_dtype=BF16, kv_dtype=BF16)),
    "fp16-gqa2-d16-b16-split64": ([130, 5, 64, 300], 64, dict(num_heads=4, num_kv_heads=2, head_dim=16,
                                                               block_size=16, q_dtype=F16, kv_dtype=F16)),
    "fp32q-bf16kv-gqa3-d64-b32-int64-strided-split128": (
        [33, 250], 128, dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=32, q_dtype=F32, kv_dtype=BF16,
                             index_dtype=torch.int64, strided=True)),
}


WINDOW_CASES = {  # name: (context_lens, partition_size, window, softcap, the cache's Shape)
    "fp32-gqa2-window1": ([1, 9, 70], None, 1, 0.0, dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                                                          q_dtype=F32, kv_dtype=F32)),
    "fp32-mha-window3-softcap": ([2, 3, 40], None, 3, 0.5, dict(num_heads=2, num_kv_heads=2, head_dim=32,
                                                                 block_size=16, q_dtype=F32, kv_dtype=F32)),
    "fp32-gqa4-softcap-only": ([5, 100], None, 0, 0.3, dict(num_heads=8, num_kv_heads=2, head_dim=16,
                                                             block_size=16, q_dtype=F32, kv_dtype=F32)),
    "fp16-gqa2-window-past-context-split64": ([130, 5, 64], 64, 500, 0.0, dict(
        num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, q_dtype=F16, kv_dtype=F16)),
    # 300 keys in partitions of 64, window 8: the first four partitions hold no key of the window, the
    # window straddles partitions 3 and 4 in the 260-token context.
    "fp32-gqa3-window8-softcap-split64": ([300, 260, 7], 64, 8, 0.4, dict(
        num_heads=6, num_kv_heads=2, head_dim=16, block_size=16, q_dtype=F32, kv_dtype=F32)),
    "bf16-gqa4-window70-b32-split64": ([200, 33], 64, 70, 0.0, dict(
        num_heads=8, num_kv_heads=2, head_dim=32, block_size=32, q_dtype=BF16, kv_dtype=BF16)),
}


def reference_decode(kv, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The torch backend's arithmetic: scaled scores, soft-capped, then only the last ``window`` keys."""
    out = torch.empty(kv.q.shape)
    for b in range(kv.q.shape[0]):
        k, v = kv.keys(b)
        if window:
            k, v = k[-window:], v[-window:]
        scores = torch.einsum("hd,nhd->hn", kv.q[b].float().cpu(), k) * kv.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def _check(triton_attention, paged_kv, close, device, contexts, partition_size, shape, window=0, softcap=0.0):
    kv = paged_kv(contexts, len(contexts), device, **shape)
    triton_attention.paged_decode_attention(kv.q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens,
                                            kv.scale, kv.out, partition_size=partition_size, window=window,
                                            softcap=softcap)
    ref = reference_decode(kv, window, softcap)
    close(kv.out, ref, shape["q_dtype"])  # float32 q: computed in float32 whatever the cache
    if softcap or 0 < window < max(contexts):  # the case must tell the feature from its absence
        assert not torch.allclose(ref, reference_decode(kv), atol=1e-2)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_reference(triton_attention, paged_kv, close, device, case):
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, device, *CASES[case])


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_decode_window_and_softcap_match_reference(triton_attention, paged_kv, close, device, case):
    contexts, partition_size, window, softcap, shape = WINDOW_CASES[case]
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, device, contexts, partition_size, shape, window, softcap)


def test_decode_tanh_saturates_without_nan(triton_attention, paged_kv, close, device):
    """A cap far below the scores: tanh saturates at +-1 (e^2x overflows or vanishes), never NaN."""
    torch.manual_seed(0)
    shape = dict(num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, q_dtype=F32, kv_dtype=F32)
    kv = paged_kv([50], 1, device, **shape)
    kv.q.mul_(1e4)
    triton_attention.paged_decode_attention(kv.q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens,
                                            kv.scale, kv.out, softcap=0.01)
    assert torch.isfinite(kv.out).all()
    close(kv.out, reference_decode(kv, 0, 0.01), F32)


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
    with pytest.raises(ValueError, match="window must be >= 0"):
        f(torch.zeros(2, 8, 16), cache, cache, tables, lens, 1.0, torch.zeros(2, 8, 16), window=-1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("contexts", [[1, 15, 16, 17, 300, 1000, 2047, 4096] * 2, [20_000, 9000]],
                         ids=["batch16-to4k", "batch2-long"])
def test_decode_llama_shapes_on_cuda(triton_attention, paged_kv, close, cuda_device, dtype, contexts):
    """Llama-8B-like heads (32 query, 8 KV, head_dim 128) in half precision, the half-precision dot on
    tensor cores that the interpreter cannot run."""
    torch.manual_seed(0)
    _check(triton_attention, paged_kv, close, cuda_device, contexts, None,
           dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, q_dtype=dtype, kv_dtype=dtype))
