"""Model families: one ``ModelFamily`` declaration is all the registry, ArchConfig and the GGUF loader
need. A made-up family ("toy": the Llama class under other names, its own GGUF tensor names, llama.cpp's
q/k permutation) is registered here and resolved by HF name, GGUF name and config.json model_type, and a
GGUF file of it loads and computes what transformers computes."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_blocks import finish_gguf, llama_cpp_permute, start_gguf
from transformers import AutoModelForCausalLM, LlamaConfig

from tideserve.model.arch_config import ArchConfig
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.loader import load_model
from tideserve.model.registry import (
    GGUFTensorMap,
    ModelFamily,
    family_for,
    hf_architecture_for_gguf,
    model_families,
    register_family,
    resolve_model_class,
    supported_architectures,
    unregister_family,
)

TOY_TENSORS = GGUFTensorMap(
    global_names={"tok.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
                  "head.weight": "lm_head.weight"},
    block_names={"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "q": "self_attn.q_proj",
                 "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    block_prefix="model.layers",
)


def toy_hf_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": bool(config.get("toy_bias", False)), "o_bias": False}


def toy_gguf_fields(tensors: Collection[str]) -> dict[str, Any]:
    return {"tie_word_embeddings": "head.weight" not in tensors}


@pytest.fixture
def toy() -> Iterator[ModelFamily]:
    family = register_family(ModelFamily(
        name="toy",
        model_class="tideserve.model.llama:LlamaForCausalLM",
        hf_architectures=("ToyForCausalLM",),
        gguf_architectures={"toy": "ToyForCausalLM"},
        model_types={"toy": "ToyForCausalLM"},
        gguf_tensors=TOY_TENSORS,
        gguf_unpermute={"self_attn.q_proj.weight": "num_attention_heads",
                        "self_attn.k_proj.weight": "num_key_value_heads"},
        hf_config_fields=toy_hf_fields,
        gguf_config_fields=toy_gguf_fields,
    ))
    yield family
    unregister_family("toy")


CONFIG = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2}


def test_a_registered_family_resolves_by_every_name(toy: ModelFamily) -> None:
    assert family_for("ToyForCausalLM") is toy and family_for("toy") is toy
    assert hf_architecture_for_gguf("toy") == "ToyForCausalLM"
    assert resolve_model_class("ToyForCausalLM") is LlamaForCausalLM
    assert resolve_model_class("toy") is LlamaForCausalLM
    assert {"ToyForCausalLM", "toy", "LlamaForCausalLM", "qwen2"} <= set(supported_architectures())
    arch = ArchConfig.from_hf_config({**CONFIG, "model_type": "toy", "toy_bias": True})
    assert arch.architecture == "ToyForCausalLM" and arch.qkv_bias and not arch.o_bias


def test_unregistered_family_is_unknown_again(toy: ModelFamily) -> None:
    unregister_family("toy")
    try:
        with pytest.raises(ValueError, match=r"unsupported GGUF general.architecture 'toy'; .*qwen2"):
            hf_architecture_for_gguf("toy")
        with pytest.raises(ValueError, match="'ToyForCausalLM'"):
            ArchConfig.from_hf_config({**CONFIG, "architectures": ["ToyForCausalLM"]})
    finally:
        register_family(toy)  # the fixture unregisters it


def test_names_belong_to_one_family(toy: ModelFamily) -> None:
    with pytest.raises(ValueError, match=r"'toy2': toy already registered by family 'toy'"):
        register_family(ModelFamily(name="toy2", model_class="x:Y", hf_architectures=("Toy2",),
                                    gguf_architectures={"toy": "Toy2"}))
    with pytest.raises(ValueError, match=r"model_class='nocolon' must be 'module:Class'"):
        ModelFamily(name="bad", model_class="nocolon", hf_architectures=("Bad",))
    with pytest.raises(ValueError, match=r"'bad': Other not in hf_architectures"):
        ModelFamily(name="bad", model_class="x:Y", hf_architectures=("Bad",), gguf_architectures={"bad": "Other"})
    assert family_for("toy") is toy and "toy2" not in {f.name for f in model_families()}


def test_builtin_families() -> None:
    assert {f.name for f in model_families()} >= {"llama", "qwen2", "qwen3", "phi3"}
    llama, qwen2, qwen3 = family_for("llama"), family_for("Qwen2ForCausalLM"), family_for("qwen3")
    assert family_for("mistral") is llama and family_for("MistralForCausalLM") is llama
    assert family_for("Qwen3ForCausalLM") is qwen3 and hf_architecture_for_gguf("qwen3") == "Qwen3ForCausalLM"
    # llama.cpp permutes llama's q/k, not qwen2's or qwen3's
    assert llama.gguf_unpermute and not qwen2.gguf_unpermute and not qwen3.gguf_unpermute
    assert qwen3.gguf_tensors.hf_name("blk.5.attn_k_norm.weight") == "model.layers.5.self_attn.k_norm.weight"
    assert qwen3.gguf_tensors.hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert llama.gguf_tensors.hf_name("blk.0.attn_q_norm.weight") is None
    config = {**CONFIG, "head_dim": 32, "architectures": ["Qwen3ForCausalLM"]}
    a = ArchConfig.from_hf_config(config)
    assert a.qk_norm and a.head_dim == 32 and not a.qkv_bias and not a.o_bias
    a = ArchConfig.from_hf_config({**config, "model_type": "qwen3", "architectures": [], "attention_bias": True})
    assert a.architecture == "Qwen3ForCausalLM" and a.qk_norm and a.qkv_bias and a.o_bias
    assert not ArchConfig.from_hf_config({**CONFIG, "architectures": ["Qwen2ForCausalLM"]}).qk_norm


def test_phi3_family() -> None:
    """Phi-3's fused GGUF tensors map onto the model's fused layers (loaded by shard), its longrope factor
    tensors are config, not weights, and llama.cpp leaves its q/k rows as HF has them."""
    phi3 = family_for("phi3")
    assert family_for("Phi3ForCausalLM") is phi3 and hf_architecture_for_gguf("phi3") == "Phi3ForCausalLM"
    assert not phi3.gguf_unpermute
    assert phi3.gguf_tensors.hf_name("blk.2.attn_qkv.weight") == "model.layers.2.self_attn.qkv_proj.weight"
    assert phi3.gguf_tensors.hf_name("blk.2.ffn_up.weight") == "model.layers.2.mlp.gate_up_proj.weight"
    assert phi3.gguf_tensors.hf_name("blk.2.ffn_down.weight") == "model.layers.2.mlp.down_proj.weight"
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= phi3.gguf_tensors.skipped
    # Phi-4-mini's shape: partial rotary, longrope with the pre-training context at the top level
    config = {**CONFIG, "architectures": [], "model_type": "phi3", "partial_rotary_factor": 0.75,
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
    a = ArchConfig.from_hf_config(config)
    assert a.architecture == "Phi3ForCausalLM" and not a.qkv_bias and not a.o_bias
    assert a.rotary_dim == a.head_dim * 3 // 4
    assert a.rope_scaling["rope_type"] == "longrope"
    assert a.rope_scaling["original_max_position_embeddings"] == 4096
    assert a.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    # the 4k models' window on every layer; a 128k model's window past its context: none
    assert ArchConfig.from_hf_config({**config, "max_position_embeddings": 4096,
                                      "sliding_window": 262144}).sliding_window is None
    a4k = ArchConfig.from_hf_config({**config, "max_position_embeddings": 4096, "sliding_window": 2047})
    assert [a4k.layer_window(i) for i in range(a4k.num_hidden_layers)] == [2047] * a4k.num_hidden_layers
    su = ArchConfig.from_hf_config({**config, "rope_scaling": {**config["rope_scaling"], "type": "su"}})
    assert su.rope_scaling == a.rope_scaling
    with pytest.raises(ValueError, match="missing long_factor"):
        ArchConfig.from_hf_config({**config, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6}})


def test_builtin_moe_families() -> None:
    """Mixtral (HF only: llama.cpp writes it as a llama file, named Mixtral by its expert tensors) and
    Qwen3-MoE (its own GGUF architecture, not q/k-permuted), and which of their layers are sparse."""
    assert {f.name for f in model_families()} >= {"mixtral", "qwen3_moe"}
    mixtral, qwen3_moe = family_for("MixtralForCausalLM"), family_for("qwen3moe")
    assert qwen3_moe is family_for("Qwen3MoeForCausalLM")
    assert hf_architecture_for_gguf("qwen3moe") == "Qwen3MoeForCausalLM"
    assert hf_architecture_for_gguf("llama") == "LlamaForCausalLM"
    experts = {"blk.0.ffn_gate_exps.weight", "output.weight"}
    assert family_for("llama").gguf_config_fields(experts)["architecture"] == "MixtralForCausalLM"
    assert "architecture" not in family_for("llama").gguf_config_fields({"output.weight"})
    assert "architecture" not in family_for("qwen3moe").gguf_config_fields(experts)
    assert mixtral.gguf_unpermute and not qwen3_moe.gguf_unpermute
    assert (mixtral.gguf_tensors.hf_name("blk.1.ffn_down_exps.weight")
            == "model.layers.1.block_sparse_moe.experts.w2.weight")
    assert qwen3_moe.gguf_tensors.hf_name("blk.1.ffn_gate_inp.weight") == "model.layers.1.mlp.gate.weight"
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 4}
    a = ArchConfig.from_hf_config({**CONFIG, **moe, "architectures": [], "model_type": "qwen3_moe",
                                   "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert a.architecture == "Qwen3MoeForCausalLM" and a.qk_norm and not a.norm_topk_prob
    assert [a.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    a = ArchConfig.from_hf_config({**CONFIG, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                   "num_experts_per_tok": 2})
    assert (a.num_experts, a.moe_intermediate_size, a.norm_topk_prob, a.dense_layers) == (8, 96, True, ())
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        ArchConfig.from_hf_config({**CONFIG, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                   "num_experts_per_tok": 9})


def test_gemma_families() -> None:
    """Gemma 2 and 3: their own model class, llama.cpp's Gemma tensor names (no q/k permutation), and the
    sliding pattern, rotary bases and norm offset read from a transformers v4-style config.json."""
    assert {f.name for f in model_families()} >= {"gemma2", "gemma3"}
    gemma2, gemma3 = family_for("gemma2"), family_for("Gemma3ForCausalLM")
    assert hf_architecture_for_gguf("gemma3") == "Gemma3ForCausalLM" and family_for("Gemma2ForCausalLM") is gemma2
    assert gemma3.model_class == gemma2.model_class == "tideserve.model.gemma:GemmaForCausalLM"
    assert not gemma2.gguf_unpermute and not gemma3.gguf_unpermute
    names = gemma3.gguf_tensors
    assert names.hf_name("blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert names.hf_name("blk.3.post_ffw_norm.weight") == "model.layers.3.post_feedforward_layernorm.weight"
    assert names.hf_name("blk.0.post_attention_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    config = {**CONFIG, "num_hidden_layers": 12, "head_dim": 32, "architectures": [], "model_type": "gemma3_text",
              "sliding_window": 512, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}
    a = ArchConfig.from_hf_config(config)
    assert a.architecture == "Gemma3ForCausalLM" and a.qk_norm and a.tie_word_embeddings
    assert a.sliding_layers == [i % 6 != 5 for i in range(12)] and a.sliding_window == 512
    assert [a.layer_window(i) for i in (0, 5, 11)] == [512, 0, 0]
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling["factor"]) == (1000000.0, 10000.0, 8.0)
    assert a.query_pre_attn_scalar == 256 and a.norm_weight_offset == 1.0 and a.attn_logit_softcapping is None
    a = ArchConfig.from_hf_config({**config, "model_type": "gemma2", "attn_logit_softcapping": 50.0})
    assert a.architecture == "Gemma2ForCausalLM" and not a.qk_norm and a.rope_local_theta is None
    assert a.sliding_layers == [i % 2 == 0 for i in range(12)] and a.attn_logit_softcapping == 50.0
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ArchConfig.from_hf_config({**config, "hidden_activation": "relu"})


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported HF "
                                         r"architectures: .*Qwen3ForCausalLM.*; supported GGUF architectures: "
                                         r".*qwen3"):
        family_for("GPT2LMHeadModel")


@pytest.mark.slow  # starts a process
def test_families_and_arch_config_need_no_torch() -> None:
    """Parsing a config reads the family declarations only: no torch, no model module."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tideserve.model.arch_config import ArchConfig\n"
        "from tideserve.model.registry import supported_architectures\n"
        f"a = ArchConfig.from_hf_config({{**{CONFIG!r}, 'architectures': ['Qwen2ForCausalLM']}})\n"
        "assert a.qkv_bias and 'llama' in supported_architectures()\n"
        "assert 'tideserve.model.llama' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_toy_gguf_loads_through_its_declaration(toy: ModelFamily, tmp_path: Path, mixed_batch: Any) -> None:
    """The file uses the toy tensor names and permuted q/k rows; only the declaration tells the loader."""
    config = LlamaConfig(**{**CONFIG, "vocab_size": 256}, max_position_embeddings=128, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    to_gguf = {hf: g for g, hf in TOY_TENSORS.global_names.items()}
    blocks = {hf: g for g, hf in TOY_TENSORS.block_names.items()}
    path = tmp_path / "toy.gguf"
    writer = start_gguf(path, "toy", config)
    for name, param in hf_model.named_parameters():
        w = param.detach().numpy().astype(np.float32)
        if name not in to_gguf:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            to_gguf[name] = f"blk.{layer}.{blocks[module]}.{kind}"
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
        writer.add_tensor(to_gguf[name], w)
    finish_gguf(writer)

    loaded = load_model(str(path), dtype="float32")
    assert loaded.arch.architecture == "ToyForCausalLM" and not loaded.arch.tie_word_embeddings
    assert isinstance(loaded.model, LlamaForCausalLM)
    mixed_batch(loaded.arch.vocab_size).assert_matches(loaded.model, hf_model)
