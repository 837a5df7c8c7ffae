"""KV bytes a Gemma 3 request holds at a long context, against full attention on every layer.

Sliding-window (local) layers keep only their window's blocks (core/kv_cache/groups.py, hybrid.py). This
runs one request through the engine to ``--context`` tokens and reads the pool's own metrics (used
blocks, pool bytes / pool blocks: what vllm:kv_cache_usage_perc is computed from), then compares with
the bytes full attention would hold (every layer, every position) and with the exact count:
    held blocks = n_full_groups * ceil(n / B) + n_sliding_groups * (ceil(n / B) - floor((n - window) / B))
(+ the one null block of the pool), about (1/6 + 5/6 x window / n) of full attention for Gemma 3.

By default the model is Gemma 3 270M's KV geometry (18 layers, every sixth global, 1 KV head of 256,
window 512) with random weights and a small hidden size (the KV bytes do not depend on it; the run stays
short). ``TIDESERVE_GEMMA3_GGUF`` names a real Gemma 3 GGUF file to run instead.

    PYTHONPATH=. python benchmarks/sliding_window_kv.py --context 4096
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from tideserve import SamplingParams
from tideserve.engine.arg_utils import EngineArgs
from tideserve.engine.llm_engine import LLMEngine
from tideserve.model.loader import load_model, resolve_model_path
from tideserve.tokenizer.tokenizer import load_tokenizer

# Gemma 3 270M's attention (config.json of google/gemma-3-270m), with a small MLP and vocabulary.
GEMMA3_270M_KV = {
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "sliding_window": 512, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
    "hidden_size": 64, "intermediate_size": 128, "vocab_size": 512,
}


def build_model(directory: str) -> str:
    path = os.environ.get("TIDESERVE_GEMMA3_GGUF")
    if path:
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**GEMMA3_270M_KV), dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    n, bs = args.context, args.block_size
    with tempfile.TemporaryDirectory() as directory:
        path = build_model(directory)
        loaded = load_model(path, dtype="float32")
        tokenizer = None if path.endswith(".gguf") else load_tokenizer_or_none()
        arch = loaded.arch
        groups = arch.kv_cache_groups()
        engine = LLMEngine.from_loaded(
            {"dtype": "float32", "block_size": bs, "max_model_len": n + 16, "enable_prefix_caching": False,
             "max_num_batched_tokens": 2048, "num_blocks": groups.num_groups * (-(-(n + 16) // bs)) + 1},
            loaded, tokenizer)
        vocab = arch.vocab_size
        rid = engine.add_request([(7 * i + 3) % vocab for i in range(n - 8)],
                                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        request = engine.scheduler.requests[rid]
        while request.num_computed_tokens < n:
            engine.step()
        stats = engine.stats()
        engine.abort_request(rid)
    per_block = stats.kv_cache_pool_bytes // stats.kv_cache_pool_blocks
    held = stats.kv_cache_used_blocks - 1  # the pool's null block aside
    windows = groups.windows
    blocks = -(-n // bs)
    expected = sum(blocks - (max(0, n - w) // bs if w else 0) for w in windows)
    full_bytes = len(groups.layer_group) * blocks * bs * 2 * arch.num_key_value_heads * arch.head_dim * 4
    window = max(windows)
    print(f"model: {arch.architecture}, {groups.describe()}, block size {bs}, context {n} tokens")
    print(f"held: {held} blocks (+1 null) x {per_block} bytes = {held * per_block / 2**20:.2f} MiB "
          f"(exact count: {expected} blocks)")
    print(f"full attention: {full_bytes / 2**20:.2f} MiB; held / full = {held * per_block / full_bytes:.4f} "
          f"(1/6 + 5/6 x {window}/{n} = {1 / 6 + 5 / 6 * window / n:.4f})")
    assert held == expected, (held, expected)


def load_tokenizer_or_none():
    """Any tokenizer will do (the prompt is token ids) and a random checkpoint has none: the default model's."""
    config = EngineArgs.coerce({}).configs()[0]
    return load_tokenizer(resolve_model_path(config.model)[0])


if __name__ == "__main__":
    main()
