"""Test helpers: GGUF block quantizers for every format tideserve's kernels take, and tiny GGUF files
(mixtures of experts included: experts stacked into 3-D tensors as llama.cpp writes them).

The gguf package quantizes the legacy formats (Q4_0 ... Q8_0) but not the K-quants or the IQ4 formats, so
Q2_K ... Q6_K, IQ4_NL and IQ4_XS are written here in numpy from ggml's block layouts (a plain min/max fit, not
llama.cpp's search: any valid blocks will do for tests) and checked against ``gguf.quants.dequantize`` in the
tests. ``random_blocks`` fills every field with random bytes (only the fp16 scales are kept finite), so the
kernels also meet codes and scales a fit would never write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

QTYPE_NAMES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0,
               "q2_k": Q.Q2_K, "q3_k": Q.Q3_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K,
               "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
# where each format keeps its fp16 scales (byte offsets in a unit): random_blocks keeps them finite
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q2_k": (80, 82),
              "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per unit -> ggml's 12 packed bytes (the inverse of get_scale_min_k4)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _quantize_k_minmax(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Units [U, 256] -> (d, dmin, sc [U, 8], mn [U, 8], q [U, 256]) with value = d sc q - dmin mn."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d = scale.max(-1) / 63
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(0, 63)
        mn = np.where(dmin16[:, None] > 0, np.rint(-lo / dmin16[:, None]), 0).clip(0, 63)
        step = d16[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint((sub + (dmin16[:, None] * mn)[..., None]) / step[..., None]), 0)
    return d, dmin, sc, mn, q.clip(0, levels).astype(np.uint8).reshape(-1, 256)


def quantize_k(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> uint8 [rows, row_bytes] of 256-value super-blocks (Q2_K ...
    Q6_K, IQ4_XS)."""
    rows, k = x.shape
    units = x.astype(np.float32).reshape(-1, 256)
    if qtype in ("q4_k", "q5_k"):
        d, dmin, sc, mn, q = _quantize_k_minmax(units, 15 if qtype == "q4_k" else 31)
        pairs = q.reshape(-1, 4, 2, 32)
        qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, mn)]
        if qtype == "q5_k":
            high = (q.reshape(-1, 8, 32) >> 4) & 1
            qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
            parts.append(qh)
        parts.append(qs)
    elif qtype == "q2_k":
        parts = _quantize_q2_k(units)
    elif qtype == "q3_k":
        parts = _quantize_q3_k(units)
    elif qtype == "iq4_xs":
        parts = _quantize_iq4_xs(units)
    elif qtype == "q6_k":
        sub = units.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = scale.max(-1) / 127
        d16 = d.astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(0, 127)
            step = (d16[:, None] * sc)[..., None]
            q = np.where(step > 0, np.rint(sub / step), 0).clip(-32, 31) + 32
        q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half, group of 32, value
        ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                             (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1).reshape(-1, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
        parts = [ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)]
    else:
        raise ValueError(qtype)
    flat = [p.reshape(units.shape[0], -1) for p in parts]
    return np.concatenate(flat, axis=1).reshape(rows, -1)


def _q2_k_scales(sub: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sub-blocks [U, 16, 16] -> (d, dmin, sc [U, 16], mn [U, 16], q [U, 16, 16]), value = d sc q - dmin mn."""
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 3
    d, dmin = scale.max(-1) / 15, (-lo).max(-1) / 15
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(0, 15)
        mn = np.where(dmin16[:, None] > 0, np.rint(-lo / dmin16[:, None]), 0).clip(0, 15)
        step = (d16[:, None] * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dmin16[:, None] * mn)[..., None]) / step), 0).clip(0, 3)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """Codes [U, 256] (below 4) -> [U, 64]: value 128 n + 32 j + l in bits 2j of byte 32 n + l."""
    q = q.reshape(-1, 2, 4, 32)
    return sum(q[:, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(-1, 64)


def _quantize_q2_k(units: np.ndarray) -> list[np.ndarray]:
    d, dmin, sc, mn, q = _q2_k_scales(units.reshape(-1, 16, 16))
    return [sc | (mn << 4), _pack_2bit(q.reshape(-1, 256)), _f16_bytes(d), _f16_bytes(dmin)]


def _quantize_q3_k(units: np.ndarray) -> list[np.ndarray]:
    """value = d (s - 32) (u - 4), u = 2 low bits | hmask bit << 2; scales s (6 bits) packed as ggml does."""
    sub = units.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 4
    d = scale.max(-1) / 31
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(0, 31)
        step = (d16[:, None] * sc)[..., None]
        u = (np.where(step > 0, np.rint(sub / step), 0).clip(-4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    high = (u >> 2).reshape(-1, 8, 32)  # sub-block j of 32: bit j of hmask
    hmask = sum(high[:, j] << j for j in range(8)).astype(np.uint8)
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((s6.shape[0], 12), dtype=np.uint8)
    scales[:, :8] = (s6[:, :8] & 0xF) | ((s6[:, 8:] & 0xF) << 4)
    for k in range(4):
        scales[:, 8 + k] = sum(((s6[:, 4 * m + k] >> 4) & 3) << (2 * m) for m in range(4))
    return [hmask, _pack_2bit(u & 3), scales, _f16_bytes(d)]


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Blocks [..., 32] over their steps [...] -> the nearest codebook entries' nibbles, packed [..., 16]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(step[..., None] != 0, x / step[..., None], 0.0)
    codes = np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    return codes[..., :16] | (codes[..., 16:] << 4)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Each block's value of largest magnitude, with its sign (mapped to the codebook's -127)."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (_signed_max(blocks) / -127).astype(np.float16)
    return np.concatenate([_f16_bytes(d), _iq4_codes(blocks, d.astype(np.float32))], -1).reshape(x.shape[0], -1)


def _quantize_iq4_xs(units: np.ndarray) -> list[np.ndarray]:
    """value = d (ls - 32) code, one 6-bit ls per 32 values (low 4 bits in scales_l, high 2 in scales_h)."""
    sub = units.reshape(-1, 8, 32)
    scale = _signed_max(sub) / -127
    d = np.abs(scale).max(-1) / 31
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(-32, 31)
    qs = _iq4_codes(sub, d16[:, None] * ls).reshape(-1, 128)
    stored = (ls + 32).astype(np.uint16)
    scales_h = sum(((stored[:, j] >> 4) & 3) << (2 * j) for j in range(8)).astype(np.uint16)
    low = (stored & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    return [_f16_bytes(d), scales_h.view(np.uint8).reshape(-1, 2), scales_l, qs]


def random_blocks(rows: int, k: int, qtype: str, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of random bytes in ``qtype``'s layout, its fp16 scales drawn in [1e-3, 1e-2)
    (random bytes there would be infinities and NaNs): every code and packed scale a format can hold."""
    from tideserve.native.quant import QUNITS

    unit, nbytes = QUNITS[qtype]
    gen = np.random.default_rng(seed)
    units = gen.integers(0, 256, (rows * k // unit, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        units[:, at:at + 2] = _f16_bytes(gen.uniform(1e-3, 1e-2, units.shape[0]))
    return units.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, k] -> uint8 [rows, row_bytes] in ``qtype`` (any format tideserve's kernels take)."""
    if qtype in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"):
        return quantize_k(x, qtype)
    if qtype == "iq4_nl":
        return _quantize_iq4_nl(x)
    return gguf.quants.quantize(x.astype(np.float32), QTYPE_NAMES[qtype])


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's own dequantization: the reference the kernels are checked against."""
    return gguf.quants.dequantize(data, QTYPE_NAMES[qtype]).astype(np.float32)


def quantized_pair(x: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks [rows, row_bytes], their float32 values per gguf) for a float weight."""
    data = quantize(x.numpy(), qtype)
    return torch.from_numpy(data.copy()), torch.from_numpy(dequantize(data, qtype))


# ------------------------------------------------------------------------------------ tiny GGUF files
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # qwen3
}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, param = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{param}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_model: Any, config: Any, path: Path, arch: str, qtypes: dict[str, str]) -> None:
    """Export ``hf_model`` as llama.cpp would, each 2-D tensor in ``qtypes[module suffix]`` (e.g.
    {"q_proj": "q4_k", ...}; "f32" keeps it float). The HF model's weights are replaced by their
    dequantized values, so it becomes the exact float reference of the file."""
    writer = start_gguf(path, arch, config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                _add_moe_tensor(writer, name, param, qtypes)
                continue
            w = param.numpy()
            qtype = qtypes.get(name.split(".")[-2], "f32") if w.ndim == 2 else "f32"
            if qtype == "f32":
                writer.add_tensor(gguf_name(name), w.astype(np.float32))
                continue
            # The blocks written are the ones the HF weight now holds the values of: quantizing those values
            # again need not give the same blocks. Blocks are per row, so permuting their rows is
            # quantizing the permuted rows.
            data = quantize(w, qtype)
            param.copy_(torch.from_numpy(dequantize(data, qtype)))
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                data = llama_cpp_permute(data, heads)
            writer.add_tensor(gguf_name(name), data, raw_dtype=QTYPE_NAMES[qtype])
    finish_gguf(writer)


def _add_moe_tensor(writer: gguf.GGUFWriter, name: str, param: torch.Tensor, qtypes: dict[str, str]) -> None:
    """A transformers MoE parameter as llama.cpp writes it: the router as ``ffn_gate_inp`` (float32), the
    fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) as 3-D
    ``ffn_{gate,up,down}_exps`` tensors, each expert's matrix in ``qtypes[<gguf name>]`` blocks (e.g.
    {"ffn_gate_exps": "q4_0"}; default f32). The parameter takes the blocks' dequantized values."""
    layer = name.split(".")[2]
    if name.endswith(".mlp.gate.weight"):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", param.numpy().astype(np.float32))
        return
    w = param.numpy()
    half = w.shape[1] // 2
    parts = ([("ffn_gate_exps", w[:, :half]), ("ffn_up_exps", w[:, half:])] if name.endswith("gate_up_proj")
             else [("ffn_down_exps", w)])
    values = []
    for key, stacked in parts:
        qtype = qtypes.get(key, "f32")
        if qtype == "f32":
            writer.add_tensor(f"blk.{layer}.{key}.weight", np.ascontiguousarray(stacked, dtype=np.float32))
            values.append(stacked)
            continue
        data = np.stack([quantize(m, qtype) for m in stacked])
        values.append(np.stack([dequantize(d, qtype) for d in data]))
        writer.add_tensor(f"blk.{layer}.{key}.weight", data, raw_dtype=QTYPE_NAMES[qtype])
    param.copy_(torch.from_numpy(np.concatenate(values, axis=1)))


def start_gguf(path: Path, arch: str, config: Any, bos: int = 1, eos: int = 2) -> gguf.GGUFWriter:
    """A GGUF writer holding the metadata llama.cpp writes for a tiny HF ``config`` (a t<i> vocabulary,
    ``bos`` and ``eos`` ids, the full-attention layers' rope, linear scaling when the config has it); the
    tensors are the caller's."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:  # as llama.cpp's converter: only when config.json has head_dim (Qwen3: not hidden / heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # per layer type (Gemma 3)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # as llama.cpp: the expert MLP size only where it is not feed_forward_length (qwen3moe)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    return writer


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
