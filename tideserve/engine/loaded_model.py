"""Building an engine over a model that is already loaded: the settings must describe that model.

Why: loading takes seconds and the weights are read-only, so several engines (the tests' fixtures, a
benchmark comparing pool settings) can share one ``LoadedModel`` while each owns its KV cache, scheduler
and runner. The engine's settings still name a model, dtype, quantization and device; here each one
given explicitly is checked against what was loaded, so a mismatch is a ValueError naming the setting,
not an engine that silently runs something else. Settings left at "auto" (or the model at None) take
the loaded model's.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import torch

from tideserve.config import ModelConfig
from tideserve.model.loader import LoadedModel, resolve_dtype

# Quantizations applied to a loaded float model when the engine is built (not while the file loads).
POST_LOAD_METHODS = ("int8",)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights live (its first parameter or buffer); CPU for a model without any."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    return requested.type == actual.type and requested.index in (None, actual.index)


def _names_model(requested: str, loaded: LoadedModel) -> bool:
    if requested in (loaded.path, loaded.name):
        return True
    try:
        return Path(requested).resolve() == Path(loaded.path).resolve()
    except OSError:
        return False


def match_loaded(config: ModelConfig, loaded: LoadedModel,
                 requested_device: torch.device | None) -> tuple[LoadedModel, torch.device]:
    """``loaded`` as the engine will run it (an int8 request over a float model marks it for quantizing
    at engine build, as ``load_model`` would) and its device; ValueError when an explicit setting
    disagrees with the loaded model. ``requested_device`` is None for ``device="auto"``."""
    device = model_device(loaded.model)
    if requested_device is not None and not _same_device(requested_device, device):
        raise ValueError(f"device={config.device!r} does not match the loaded model, whose weights are on "
                         f"{device}; load the model on that device or leave device at 'auto'.")
    if config.model is not None and not _names_model(config.model, loaded):
        raise ValueError(f"model={config.model!r} does not match the loaded model {loaded.path!r}; leave model "
                         "unset (None) to serve the loaded one.")
    if config.dtype != "auto" and resolve_dtype(config.dtype, device) != loaded.dtype:
        raise ValueError(f"dtype={config.dtype!r} does not match the loaded model, which computes in "
                         f"{str(loaded.dtype).removeprefix('torch.')}; load it with that dtype or leave dtype "
                         "at 'auto'.")
    wanted = config.quantization
    if wanted in ("auto", loaded.quantization):
        return loaded, device
    if wanted in POST_LOAD_METHODS and loaded.quantization == "none":
        return replace(loaded, quantization=wanted), device
    raise ValueError(f"quantization={wanted!r} does not match the loaded model (quantization "
                     f"{loaded.quantization!r}); load it with that quantization or leave quantization at 'auto'.")
