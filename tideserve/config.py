"""Validated engine configuration.

Each dataclass checks its own fields; cross-field checks that need the model (its trained context) live
in ``EngineConfig.finalize``. User mistakes raise ``ValueError`` naming the parameter, value and limit.
"""

from __future__ import annotations

from dataclasses import dataclass

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # fixed pool size in blocks (tests, preemption experiments)
    kv_cache_memory: int | None = None  # fixed pool size in bytes
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {self.block_size!r}.")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}.")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}."
            )


@dataclass
class ModelConfig:
    model: str | None = None  # local GGUF file, local HF directory or hub id; None = embedded default
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None = the model's trained context
    allow_long_max_model_len: bool = False  # accept max_model_len beyond the trained context
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}."
            )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}.")


def resolve_max_model_len(requested: int | None, trained: int, allow_long: bool) -> int:
    """The context the engine serves: the model's trained one unless the user asks for another."""
    if requested is None:
        return trained
    if requested > trained and not allow_long:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's trained context of {trained} tokens; "
            "pass a smaller max_model_len, or allow_long_max_model_len=True "
            "(--allow-long-max-model-len) to override at your own risk."
        )
    return requested
