"""Larger GGUF models for checking speed and memory beyond the embedded 135M one, built offline.

Speed and memory on the 135M model say little about a user's larger K-quant files, and the hub may be out
of reach, so this writes random-weight models of two public shapes with the embedded model's tokenizer (copied
field by field from its GGUF), in float16, and has llama.cpp's ``llama-quantize`` (built from the same
sources as the peer server: docs/benchmarks.md) turn them into Q4_K_M as a user's file would be:

  llama-1.7b   SmolLM2-1.7B's shape: hidden 2048, 24 layers, 32 heads (no GQA), MLP 8192 (~1.06 GB)
  qwen2-0.5b   Qwen2-0.5B's shape with a 49,152-token vocabulary: hidden 896, 24 layers, 14 heads over 2
               KV heads, MLP 4864, q/k/v biases (~0.30 GB)

Random weights make meaningless text but the same work per token as trained ones (greedy, EOS ignored),
which is what throughput, latency and resident memory measure.

    .venv/bin/python benchmarks/checking_models.py --llama-quantize path/to/llama-quantize --out out/checking-models
    .venv/bin/python benchmarks/compare.py --model out/checking-models/llama-1.7b-q4_k_m.gguf \\
        --workloads fixed --concurrency 1 --num-prompts 8 --engines tideserve-serve,llama-server ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tideserve.model.loader import default_model_path  # noqa: E402

SHAPES = {
    "llama-1.7b": dict(arch="llama", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, bias=False,
                       rope_base=130000.0, eps=1e-5, context=8192),
    "qwen2-0.5b": dict(arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, bias=True,
                       rope_base=1000000.0, eps=1e-6, context=32768),
}


def embedded_gguf() -> Path:
    """The embedded SmolLM2 file, whose tokenizer the checking models share."""
    try:
        return Path(default_model_path())
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Every ``tokenizer.*`` field of ``reader`` into ``writer``; returns the vocabulary size."""
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, main, sub_type=field.types[-1])
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(name, value, main)
    return vocab


def write_f16_model(shape: dict, path: Path, seed: int = 0) -> Path:
    """A random float16 GGUF of ``shape`` (one of SHAPES' values; weights ~N(0, 0.02), norms 1, biases 0) at
    ``path``, tokenizer from the embedded model."""
    arch, hidden, heads, kv_heads = shape["arch"], shape["hidden"], shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(str(embedded_gguf()))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tideserve checking model {path.stem} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(reader, writer)
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_rope_freq_base(shape["rope_base"])
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for i in range(shape["layers"]):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        for part, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            writer.add_tensor(f"{blk}.attn_{part}.weight", weight(rows, hidden))
            if shape["bias"]:
                writer.add_tensor(f"{blk}.attn_{part}.bias", np.zeros(rows, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(shape["ffn"], hidden))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(shape["ffn"], hidden))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(hidden, shape["ffn"]))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))  # output tied to token_embd
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--out", default="out/checking-models")
    ap.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's target type")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        f16 = write_f16_model(SHAPES[name], out / f"{name}-f16.gguf")
        target = out / f"{name}-{args.type.lower()}.gguf"
        done = subprocess.run([args.llama_quantize, str(f16), str(target), args.type], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize failed on {f16}:\n{done.stderr[-4000:]}")
        f16.unlink()
        print(f"wrote {target} ({target.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)


if __name__ == "__main__":
    main()
