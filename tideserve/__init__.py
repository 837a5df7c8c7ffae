"""tideserve: LLM inference and serving with a paged, elastic KV cache and continuous batching."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names, imported on first use so that `import tideserve.core...` stays light.
_EXPORTS = {
    "LLM": "tideserve.engine.llm",
    "LLMEngine": "tideserve.engine.llm_engine",
    "EngineArgs": "tideserve.engine.arg_utils",
    "AsyncEngine": "tideserve.engine.async_engine",
    "AsyncLLMEngine": "tideserve.engine.async_engine",
    "SamplingParams": "tideserve.sampling_params",
    "StructuredOutputsParams": "tideserve.structured_outputs_params",
    "RequestOutput": "tideserve.outputs",
    "CompletionOutput": "tideserve.outputs",
    "Logprob": "tideserve.outputs",
    "PoolingParams": "tideserve.pooling_params",
    "EmbeddingRequestOutput": "tideserve.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tideserve' has no attribute {name!r}")
