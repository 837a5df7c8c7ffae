"""Mixtral: Mistral's attention with a mixture of SwiGLU experts in every layer
(``tideserve.model.llama.LlamaForCausalLM``, whose MLP becomes ``tideserve.model.moe.SparseMoeBlock``).

llama.cpp converts Mixtral as a ``llama`` GGUF file with ``llama.expert_count`` metadata, q/k rows
permuted like Llama's, and each layer's experts stacked into 3-D tensors; the llama family's
``gguf_config_fields`` names such a file ``MixtralForCausalLM``, so its tensors are read with this map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tideserve.model.families import llama
from tideserve.model.registry import GGUFTensorMap, ModelFamily

GGUF_TENSORS = GGUFTensorMap(
    global_names=llama.GGUF_TENSORS.global_names,
    block_names={**llama.GGUF_TENSORS.block_names,
                 # [n_expert, out, in]: the loader splits them into the per-expert checkpoint names
                 "ffn_gate_inp": "block_sparse_moe.gate",
                 "ffn_gate_exps": "block_sparse_moe.experts.w1",
                 "ffn_down_exps": "block_sparse_moe.experts.w2",
                 "ffn_up_exps": "block_sparse_moe.experts.w3"},
    skipped=llama.GGUF_TENSORS.skipped,
)


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer is sparse; ``intermediate_size`` is each expert's; the top-k weights are renormalised."""
    return {
        **llama.hf_config_fields(config),
        "num_experts": int(config["num_local_experts"]),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["intermediate_size"]),
        "norm_topk_prob": True,
    }


FAMILY = ModelFamily(
    name="mixtral",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    hf_architectures=("MixtralForCausalLM",),
    model_types={"mixtral": "MixtralForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    gguf_unpermute=llama.FAMILY.gguf_unpermute,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=llama.gguf_config_fields,
)
