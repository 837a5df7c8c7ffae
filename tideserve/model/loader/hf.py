"""HF checkpoint directories: config.json (+ generation_config.json) and *.safetensors, sharded or not."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tideserve.model.arch_config import ArchConfig
from tideserve.model.registry import resolve_model_class

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_arch_config(path: Path) -> ArchConfig:
    """ArchConfig from config.json; eos ids from generation_config.json are added (Llama 3 instruct keeps
    <|eot_id|> only there)."""
    config = json.loads((path / "config.json").read_text())
    arch = ArchConfig.from_hf_config(config)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if int(e) not in arch.eos_token_ids:
                arch.eos_token_ids.append(int(e))
    return arch


def safetensors_files(path: Path) -> list[Path]:
    """The shards named by the index file, else every *.safetensors in the directory."""
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has config.json but no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{_INDEX} names missing shard files: {', '.join(missing)}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_hf(path: str, dtype: torch.dtype, device: torch.device | str, quantization: str = "none"
            ) -> tuple[torch.nn.Module, ArchConfig]:
    """Build the model for an HF directory and load its safetensors weights; with quantization "int4" each
    projection becomes q4_1 blocks (the embedding table and LM head q8_0) as soon as its tensors are read,
    so the float model is never whole in memory."""
    root = Path(path)
    arch = read_arch_config(root)
    files = safetensors_files(root)
    logger.info("HF checkpoint %s: %s, %d layers, %d safetensors file(s)", path, arch.architecture,
                arch.num_hidden_layers, len(files))
    model = resolve_model_class(arch.architecture)(arch, dtype=dtype, device=device)
    if quantization == "int4":
        from tideserve.model.layers.quant.blocks import quantize_blocks

        model.begin_quantized_load(lambda w: ("q4_1", quantize_blocks(w, "q4_1")),
                                   lambda w: ("q8_0", quantize_blocks(w, "q8_0")))
    elif quantization != "none":
        raise ValueError(f"quantization {quantization!r} is not applied while loading an HF checkpoint")
    weights = iter_safetensors(files)
    if not arch.generates:  # a headless checkpoint names its tensors without the "model." prefix
        weights = ((name if name.startswith("model.") else f"model.{name}", tensor) for name, tensor in weights)
    model.load_weights(weights)
    return model.eval(), arch
