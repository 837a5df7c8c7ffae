"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of SwiGLU experts in the sparse
layers (``tideserve.model.llama.LlamaForCausalLM``, whose MLP becomes ``tideserve.model.moe.SparseMoeBlock``).

A layer is dense (an MLP of ``intermediate_size``) when config.json lists it in ``mlp_only_layers`` or
``decoder_sparse_step`` skips it. llama.cpp's ``qwen3moe`` files are not q/k-permuted, stack each layer's
experts into 3-D tensors and carry no dense-layer list: a layer without a router tensor is dense.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tideserve.model.families import qwen3
from tideserve.model.registry import GGUFTensorMap, ModelFamily

GGUF_TENSORS = GGUFTensorMap(
    global_names=qwen3.GGUF_TENSORS.global_names,
    block_names={**qwen3.GGUF_TENSORS.block_names,
                 # [n_expert, out, in]: the loader splits them into the per-expert checkpoint names
                 "ffn_gate_inp": "mlp.gate",
                 "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj",
                 "ffn_down_exps": "mlp.experts.down_proj"},
    skipped=qwen3.GGUF_TENSORS.skipped,
)


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3's fields plus the experts; the dense layers as transformers picks them."""
    layers = int(config["num_hidden_layers"])
    # released checkpoints say num_experts; transformers 5 saves it as num_local_experts
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = set(config.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only_mlp or not experts or (i + 1) % step)
    return {
        **qwen3.hf_config_fields(config),
        "num_experts": experts,
        "num_experts_per_tok": int(config.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    """As Qwen3's (the experts are read from the metadata every MoE file shares)."""
    return qwen3.gguf_config_fields(tensors)


FAMILY = ModelFamily(
    name="qwen3_moe",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_architectures={"qwen3moe": "Qwen3MoeForCausalLM"},
    model_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
)
