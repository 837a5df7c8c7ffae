"""Architecture names -> classes, and ArchConfig parsing of both config.json layouts."""

from __future__ import annotations

import pytest

from tideserve.model.arch_config import ArchConfig
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.registry import hf_architecture_for_gguf, resolve_model_class, supported_architectures

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Phi3ForCausalLM", "llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_supported_names_resolve(name: str) -> None:
    assert resolve_model_class(name) is LlamaForCausalLM
    assert name in supported_architectures()


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2ForCausalLM.*qwen2"):
        resolve_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"'gpt2'.*supported GGUF architectures: (.*, )?llama, mistral.*qwen2"):
        hf_architecture_for_gguf("gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ArchConfig.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_hf_config_v4_layout() -> None:
    arch = ArchConfig.from_hf_config({
        **BASE, "rope_theta": 500000.0, "eos_token_id": [1, 7], "bos_token_id": 0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    })
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "llama3"
    assert arch.head_dim == 16 and arch.eos_token_ids == [1, 7] and arch.bos_token_id == 0
    assert not arch.qkv_bias and not arch.tie_word_embeddings


def test_hf_config_v5_layout_and_qwen2_bias() -> None:
    arch = ArchConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": 5,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None
    assert arch.qkv_bias and not arch.o_bias and arch.eos_token_ids == [5]


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0},
                                     {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling(scaling: dict) -> None:
    with pytest.raises(ValueError, match=r"rope_scaling type .* is not supported; supported: llama3, linear"):
        ArchConfig.from_hf_config({**BASE, "rope_scaling": scaling})


def test_bad_head_counts() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4 must be a multiple of num_key_value_heads=3"):
        ArchConfig.from_hf_config({**BASE, "num_key_value_heads": 3})
