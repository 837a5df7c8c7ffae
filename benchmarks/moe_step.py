"""A mixture-of-experts decode step against a dense one with the same active parameters per token.

The MoE model has ``--experts`` SwiGLU experts of ``--inter`` and routes each token to ``--top-k`` of them;
the dense model has one MLP of ``top_k * inter``, the same hidden size, layers and attention. So at batch 1
both multiply by the same number of weights per step and the ratio is the MoE path's own cost (routing,
the sort by expert, one call per active expert, the scatter-add). At larger batches the tokens spread over
more experts, so the MoE step reads more weights than the dense one (up to ``experts / top_k`` times the
MLP's), which is the price of its larger total parameter count.

Random weights (routing is then roughly uniform), one decode step of ``--batch`` sequences whose
``--context`` cached tokens sit in a paged KV cache; the median of ``--steps`` timed steps after warm-up,
forward and LM head. ``--quantization int4`` runs both on q4_1 blocks (native kernels; the native decode
step, which fuses a dense model's layers, is off for both so the comparison stays per layer in Python).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/moe_step.py --batch 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.attention import BatchLayout, select_attention_backend
from tideserve.model.llama import LlamaForCausalLM


def build(args: argparse.Namespace, moe: bool) -> LlamaForCausalLM:
    experts = {"num_experts": args.experts, "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.inter}
    arch = ArchConfig(
        architecture="MixtralForCausalLM" if moe else "LlamaForCausalLM", vocab_size=args.vocab,
        hidden_size=args.hidden, intermediate_size=args.inter if moe else args.top_k * args.inter,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.context + 64, **(experts if moe else {}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    if args.quantization == "int4":
        from tideserve.model.layers.quant.transform import quantize_model

        model, _ = quantize_model(model, "int4", torch.device("cpu"))
        model.native_decode = None
    return model.eval()


@torch.inference_mode()
def step_seconds(model: LlamaForCausalLM, args: argparse.Namespace, batch: int) -> float:
    """Median seconds of one decode step of ``batch`` sequences at ``--context`` cached tokens each."""
    arch, block = model.arch, 16
    per_seq = -(-(args.context + 1) // block)
    backend = select_attention_backend(args.backend, "cpu", model.dtype, model.dtype, arch.num_attention_heads,
                                       arch.num_key_value_heads, arch.head_dim)
    shape = (batch * per_seq, block, arch.num_key_value_heads, arch.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(arch.num_hidden_layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    layout = BatchLayout.from_lists(tables, [args.context] * batch, [1] * batch, block)
    meta = backend.build_metadata(layout)
    ids = torch.randint(0, arch.vocab_size, (batch,))
    positions = torch.from_numpy(layout.positions)

    def run() -> None:
        model.compute_logits(model(ids, positions, caches, meta))

    for _ in range(3):
        run()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=1024, help="each expert's MLP size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="cpu-native", help="attention backend")
    parser.add_argument("--quantization", choices=("none", "int4"), default="none")
    args = parser.parse_args()
    moe, dense = build(args, moe=True), build(args, moe=False)
    for batch in args.batch:
        # interleaved rounds, so a shared host's drift lands on both arms alike
        pairs = [(step_seconds(moe, args, batch), step_seconds(dense, args, batch)) for _ in range(3)]
        m, d = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        print(json.dumps({"batch": batch, "quantization": args.quantization, "moe_ms": round(m * 1e3, 3),
                          "dense_ms": round(d * 1e3, 3), "moe_over_dense": round(m / d, 3),
                          "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
