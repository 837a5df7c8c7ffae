"""GGUF block formats for float weights: ``q4_1`` (``--quantization int4``'s layers) and ``q8_0`` (its LM
head), and the float values of any GGUF blocks.

Why blocks: a single decode stream is bound by how fast weights stream from memory, and fbgemm has no
4-bit kernel. Blocks of 32 weights with an fp16 scale and minimum each (GGUF's Q4_1 layout, about 5 bits
per weight) read 0.6 bytes per weight against int8's 1 and float32's 4, and the embedded SmolLM2's GGUF
weights are already Q4_1, so quantizing their dequantized values gives the file's blocks back. The LM
head, the one matrix whose errors land directly on the logits, gets 8-bit blocks, as the GGUF's own Q8_0
embedding table does. The kernels that multiply them live in tideserve/native/qgemm.c.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per block of the block-quantized formats


def quantize_blocks(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """weight [N, K] -> uint8 [N, row_bytes] of GGUF ``q4_1`` or ``q8_0`` blocks.

    q4_1: per block of 32, m = the block's minimum and d = its range / 15, both rounded to fp16 before the
    4-bit codes are computed, so the codes fit the stored numbers (and a Q4_1 file's dequantized values
    give its own blocks back). q8_0: d = the largest magnitude / 127.
    """
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"block-quantized weights need in_features divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if qtype == "q4_1":
        low = blocks.amin(dim=-1).clamp(-65504, 65504).half()
        d = ((blocks.amax(dim=-1) - low.float()) / 15).clamp(max=65504).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = ((blocks - low.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        qs = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
        parts = [d.view(torch.uint8).reshape(n, -1, 2), low.view(torch.uint8).reshape(n, -1, 2), qs]
    elif qtype == "q8_0":
        d = (blocks.abs().amax(dim=-1) / 127).clamp(max=65504).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        codes = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        parts = [d.view(torch.uint8).reshape(n, -1, 2), codes.view(torch.uint8)]
    else:
        raise ValueError(f"weights can be quantized to q4_1 or q8_0 here, not {qtype!r}")
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def dequantize_blocks(data: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The float32 [N, K] values of GGUF blocks (the gguf package's own dequantization)."""
    import gguf

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype.upper()])
    return torch.from_numpy(values.astype("float32", copy=False).reshape(data.shape[0], in_features))
