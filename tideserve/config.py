"""Validated engine configuration.

Each dataclass checks its own fields; cross-field checks that need the model (its trained context) live
in ``EngineConfig.finalize``. User mistakes raise ``ValueError`` naming the parameter, value and limit.
"""

from __future__ import annotations

from dataclasses import dataclass

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)


def parse_size(value: int | float | str | None, name: str) -> int | None:
    """Bytes from 4GiB, 512MiB, 2GB, 1.5e9 or a plain number (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    text = str(value).strip().lower()
    for unit, mult in units.items():
        if text.endswith(unit):
            text, factor = text[: -len(unit)].strip(), mult
            break
    else:
        factor = 1
    try:
        return int(float(text) * factor)
    except ValueError:
        raise ValueError(f"{name} must be a size such as 4GiB, 512MiB or a byte count, got {value!r}.") from None


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# --quantization (model/layers/quantization.py; "gguf" keeps a GGUF file's own blocks)
QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8", "int4")


@dataclass
class CacheConfig:
    """KV cache settings. The pool is elastic (sized from measurement, grows and shrinks with load)
    unless num_blocks, kv_cache_memory or gpu_memory_utilization fixes it."""

    block_size: int | str = "auto"  # 8, 16, 32, 64, 128 or "auto" (chosen from the workload)
    num_blocks: int | None = None  # fixed pool size in blocks (tests, preemption experiments)
    kv_cache_memory: int | str | None = None  # fixed pool size in bytes, e.g. "4GiB"
    gpu_memory_utilization: float | None = None  # fixed pool: this share of the device (or host) memory
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), float32, bfloat16 or float16
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of host memory for preemption_mode="swap"

    def __post_init__(self) -> None:
        if self.block_size != "auto" and self.block_size not in VALID_BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {VALID_BLOCK_SIZES} or 'auto', got {self.block_size!r}.")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}.")
        self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}.")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}.")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}.")

    @property
    def auto_block_size(self) -> bool:
        return self.block_size == "auto"

    @property
    def initial_block_size(self) -> int:
        return 16 if self.block_size == "auto" else int(self.block_size)

    @property
    def is_static(self) -> bool:
        return (self.num_blocks is not None or self.kv_cache_memory is not None
                or self.gpu_memory_utilization is not None)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}.")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}."
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")


@dataclass
class ModelConfig:
    model: str | None = None  # local GGUF file, local HF directory or hub id; None = embedded default
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None = the model's trained context
    allow_long_max_model_len: bool = False  # accept max_model_len beyond the trained context
    seed: int = 0
    # auto: a quantized GGUF runs on its own blocks ("gguf"), anything else in float ("none"); int8, int4:
    # quantized linear layers (see model/layers/quantization.py)
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}."
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}.")
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
