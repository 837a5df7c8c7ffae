"""Validated engine configuration.

Each dataclass checks its own fields; cross-field checks that need the model (its trained context) live
in ``EngineConfig.finalize``. User mistakes raise ``ValueError`` naming the parameter, value and limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tideserve.pooling_params import PoolerConfig, parse_pooler_config
from tideserve.settings import KV_GROUP, config_from_json, setting

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_KV_CACHE_DIR_SIZE = 16 * 2**30  # the disk tier's bound when --kv-cache-dir-size is not given


_SIZE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "tb": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "k": 2**10, "m": 2**20,
               "g": 2**30, "t": 2**40, "b": 1}


def _split_size(value: str, name: str) -> tuple[float, int | None]:
    """(number, unit multiplier or None when no unit was written) of a size such as '16G' or '1.5e9'."""
    text = value.strip().lower()
    factor = None
    for unit, mult in _SIZE_UNITS.items():
        if text.endswith(unit):
            text, factor = text[: -len(unit)].strip(), mult
            break
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a size such as 4GiB, 512MiB, 16G or a byte count, got {value!r}.")
    return number, factor


def parse_size(value: int | float | str | None, name: str) -> int | None:
    """Bytes from 4GiB, 512MiB, 16G, 2GB, 1.5e9 or a plain number of bytes (None stays None).

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024 (as in vLLM and Kubernetes' Ki/Mi/Gi); KB/MB/GB/TB
    are powers of 1000."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite size in bytes, got {value!r}.")
        return int(value)
    number, factor = _split_size(str(value), name)
    return int(number * (factor or 1))


def parse_gib(value: int | float | str, name: str) -> float:
    """GiB from '16G', '4GiB', '512M' or a bare number, which means GiB (vLLM's ``--swap-space 4``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, factor = float(value), None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{name} must be >= 0 GiB, got {value!r}.")
    elif isinstance(value, str):
        number, factor = _split_size(value, name)
    else:
        raise ValueError(f"{name} must be a size such as 16G, 4GiB, 512M or a number of GiB, got {value!r}.")
    return number if factor is None else number * factor / 2**30


def _block_size(text: str) -> int | str:
    """--block-size: a number or "auto" (named so argparse's error reads "invalid _block_size value")."""
    return "auto" if text == "auto" else int(text)


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3")
# fp8 is float8 e4m3 ("fn") with a scale of 1.0, vLLM's fp8 cache without calibrated scales
KV_CACHE_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                         "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_ENCODINGS = ("map", "array")


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: publish KV cache events (blocks stored in and removed from the prefix
    cache) so a router can route on the real cache state. Field names and defaults are vLLM's; the
    publisher is tideserve/engine/kv_events.py. ``publisher`` None means "zmq" when enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # a wildcard or ipc/inproc address is bound, a host:port connected to
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it new ones are dropped
    topic: str = ""
    # tideserve's addition: how each event is laid out, since vLLM changed it. "map": tagged by "type"
    # (current vLLM; what vllm-router's kv_aware decodes); "array": vLLM's original positional layout.
    event_encoding: str = "map"

    def __post_init__(self) -> None:
        name = "kv_events_config"
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"{name}.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}.")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"{name}.publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, "
                             f"got {self.publisher!r}.")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name}.{key} must be a ZMQ address such as tcp://*:5557 or "
                                 f"tcp://127.0.0.1:5557, got {value!r}.")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{key} must be an integer >= 1, got {value!r}.")
        if not isinstance(self.topic, str):
            raise ValueError(f"{name}.topic must be a string, got {self.topic!r}.")
        if self.event_encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"{name}.event_encoding must be one of {', '.join(KV_EVENT_ENCODINGS)}, "
                             f"got {self.event_encoding!r}.")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """A KVEventsConfig from JSON text (the flag), a dict (Python) or one already built; None stays None."""
    return config_from_json(value, KVEventsConfig, "kv_events_config",
                            '{"enable_kv_cache_events": true, "publisher": "zmq"}')


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: propose ``num_speculative_tokens`` tokens per step and verify them in
    one forward pass (tideserve/spec_decode/). ``method`` "ngram" looks the proposals up in the request's own
    prompt and output: the tokens that followed the latest earlier occurrence of its last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``. ``method`` "draft_model" (implied by ``model``) has a
    smaller model with the same vocabulary and KV geometry (KV heads, head size) propose them greedily; its
    KV lives in the same pool as extra layers (spec_decode/draft.py). Field names are vLLM's;
    ``disable_by_batch_size`` (vLLM's too) stops proposing while at least that many requests run, where a step
    is bound by arithmetic rather than by reading the weights, so verifying proposals costs more than it
    saves."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model's path (method "draft_model")
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        name = "speculative_config"
        if self.method is None:
            self.method = ("draft_model" if self.model is not None else
                           "ngram" if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None
                           else None)
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{name}.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}.")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f'{name}.model must name the draft model (a path or file) for method "draft_model", '
                             f"got {self.model!r}.")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f'{name}.model ({self.model!r}) is for method "draft_model"; method "ngram" looks '
                             "its proposals up in the request's own text: drop one of the two.")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"{name}.num_speculative_tokens must be an integer in [1, 32], got {k!r}.")
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(3, self.prompt_lookup_min or 1)
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = min(2, self.prompt_lookup_max)
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{key} must be an integer >= 1, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{name}.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max}).")
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = 8
        value = self.disable_by_batch_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.disable_by_batch_size must be an integer >= 1, got {value!r}.")


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from JSON text (the flag), a dict (Python) or one already built; None stays None."""
    return config_from_json(value, SpeculativeConfig, "speculative_config",
                            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')


@dataclass
class CacheConfig:
    """KV cache settings. The pool is elastic (sized from measurement, grows and shrinks with load)
    unless num_blocks, kv_cache_memory or gpu_memory_utilization fixes it."""

    block_size: int | str = setting(
        "auto", group=KV_GROUP, type=_block_size,
        help=f"{', '.join(map(str, VALID_BLOCK_SIZES))} or auto (chosen from the workload)")
    # fixed pool size in blocks (tests, preemption experiments)
    num_blocks: int | None = setting(None, group=KV_GROUP, aliases=("--num-gpu-blocks-override",),
                                     help="fix the pool at this many blocks")
    kv_cache_memory: int | str | None = setting(  # parsed to bytes in __post_init__
        None, group=KV_GROUP, aliases=("--kv-cache-memory-bytes",),
        help="fix the pool at this size: 4GiB, 512M, 2e9 or bytes (static mode)")
    gpu_memory_utilization: float | None = setting(
        None, group=KV_GROUP, help="fix the pool at this share of device (or host) memory (static mode)")
    kv_cache_dtype: str = setting(
        "auto", group=KV_GROUP, choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype (bfloat16 for a GGUF's own blocks where the native kernels run); bfloat16 holds "
             "twice the tokens of float32 per byte and halves the bytes decode attention reads; fp8 (e4m3, "
             "values rounded to 3 mantissa bits, saturating at +-448) halves them again at a small cost in "
             "quality (docs/benchmarks.md)")
    enable_prefix_caching: bool = setting(True, group=KV_GROUP)
    # GiB of host memory for preemption_mode="swap" (parsed to GiB in __post_init__)
    swap_space: float | str = setting(
        4.0, group=KV_GROUP,
        help="host memory for swap preemption: 16G, 4GiB, 512M, or a bare number of GiB (default {default:g})")
    # parsed to a KVEventsConfig (or None) in __post_init__
    kv_events_config: KVEventsConfig | dict | str | None = setting(
        None, group=KV_GROUP, metavar="JSON",
        help='publish KV cache events in vLLM\'s format, e.g. \'{"enable_kv_cache_events": true, "publisher": '
             '"zmq", "endpoint": "tcp://*:5557"}\' (docs/deployment.md)')
    kv_cache_dir: str | None = setting(
        None, group=KV_GROUP, metavar="PATH",
        help="keep full prefix blocks in files under PATH too (a disk tier below the pool): blocks that leave the "
             "pool are loaded back instead of recomputed, and a server restarted on the same PATH with the same "
             "model and settings serves them at once (docs/architecture.md)")
    kv_cache_dir_size: int | str | None = setting(  # parsed to bytes in __post_init__
        None, group=KV_GROUP, metavar="SIZE",
        help=f"the most the disk tier keeps: 64GiB, 500M or bytes (default {DEFAULT_KV_CACHE_DIR_SIZE // 2**30}GiB); "
             "least recently used blocks go first")
    # GiB of host memory for the host tier (vLLM's flag; parsed to GiB in __post_init__; 0 or None: off)
    kv_offloading_size: float | str | None = setting(
        None, group=KV_GROUP, metavar="SIZE",
        help="keep full prefix blocks in this much host memory too (a host tier below the pool, above the disk "
             "tier; on CPU outside the elastic pool, so an idle shrink keeps its prefixes): 8GiB, 512M, or a "
             "bare number of GiB as in vLLM; least recently used blocks go first (docs/architecture.md)")

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
        self.swap_space = parse_gib(self.swap_space, "swap_space")
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        self.kv_cache_dir_size = parse_size(self.kv_cache_dir_size, "kv_cache_dir_size")
        if self.kv_cache_dir_size is not None and self.kv_cache_dir_size <= 0:
            raise ValueError(f"kv_cache_dir_size must be > 0 bytes, got {self.kv_cache_dir_size!r}.")
        if self.kv_offloading_size is not None:
            self.kv_offloading_size = parse_gib(self.kv_offloading_size, "kv_offloading_size")
        if self.kv_cache_dir_size is not None and not self.kv_cache_dir:
            raise ValueError("kv_cache_dir_size is set but kv_cache_dir is not: name the directory of the disk "
                             "tier (--kv-cache-dir PATH) or drop the size.")

    @property
    def kv_offloading_bytes(self) -> int:
        """The host tier's bound in bytes (0: no host tier)."""
        return int((self.kv_offloading_size or 0) * 2**30)

    @property
    def kv_cache_dir_bytes(self) -> int:
        """The disk tier's bound in bytes (its default when ``kv_cache_dir_size`` is unset)."""
        return self.kv_cache_dir_size if self.kv_cache_dir_size is not None else DEFAULT_KV_CACHE_DIR_SIZE

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


SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = setting(128, help="max_num_seqs: requests in one batch")
    # EngineArgs' None: this default with chunked prefill; without it, at least max_model_len (the engine
    # raises it so a prompt runs in one step)
    max_num_batched_tokens: int = setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, unset=True,
        help="tokens per step (default {default}; without chunked prefill at least max_model_len)")
    enable_chunked_prefill: bool = setting(True, help="on by default, as in vLLM")
    preemption_mode: str = setting("recompute", group=KV_GROUP, choices=PREEMPTION_MODES)
    # fcfs: arrival order; priority: by each request's priority (lower first), then arrival (vLLM's).
    scheduling_policy: str = setting(
        "fcfs", choices=SCHEDULING_POLICIES,
        help="fcfs: arrival order; priority: by each request's priority field (lower first, then arrival), "
             "preempting lower-priority requests for higher ones")
    # parsed to a SpeculativeConfig (or None) in __post_init__
    speculative_config: SpeculativeConfig | dict | str | None = setting(
        None, metavar="JSON",
        help='speculative decoding in vLLM\'s format, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4}\': proposals from the request\'s own text, verified in one forward pass '
             '(greedy output unchanged); \'{"model": PATH, "num_speculative_tokens": 4}\': a smaller draft model '
             'with the same vocabulary and KV geometry proposes them')

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}.")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}."
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        self.speculative_config = parse_speculative_config(self.speculative_config)


# --attention-backend (model/attention/): auto picks cpu-native on the CPU, triton on CUDA, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "cpu-native", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# --quantization (model/layers/quant/): auto, the file's own blocks for a quantized GGUF ("gguf"),
# float ("none"), or quantized linear layers ("int8", "int4").
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
# vLLM's names for checkpoint formats tideserve cannot read (its GGUF and float loaders cover the rest).
VLLM_CHECKPOINT_QUANTIZATIONS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "fp8", "fbgemm_fp8",
                                 "bitsandbytes", "squeezellm", "compressed-tensors", "aqlm", "hqq", "modelopt",
                                 "deepspeedfp", "experts_int8", "mxfp4", "nvfp4", "torchao")


@dataclass
class ModelConfig:
    # local GGUF file, local HF directory or hub id; None = embedded default
    model: str | None = setting(None, help="GGUF file, HF directory or hub id (default: embedded SmolLM2)")
    dtype: str = setting(  # also vLLM's aliases: half (float16), float (float32)
        "auto", choices=(*DTYPES, *DTYPE_ALIASES),
        help="auto: bfloat16 where the device computes it fast, else float32 (half = float16, float = float32)")
    device: str = setting("auto")
    max_model_len: int | None = setting(  # None = the model's trained context
        None, help="max_model_len: context length in tokens, prompt plus output (default: the model's trained "
                   "context)")
    allow_long_max_model_len: bool = setting(False)  # accept max_model_len beyond the trained context
    seed: int = setting(0)
    # auto: a quantized GGUF runs on its own blocks ("gguf"), anything else in float ("none"); int8, int4:
    # quantized linear layers (see model/layers/quant/). The parser leaves the check to
    # _check_quantization, which explains vLLM's checkpoint formats.
    quantization: str | None = setting(
        "auto", aliases=("-q",), choices=QUANTIZATIONS, parser_choices=False,
        help="auto (default): a quantized GGUF runs on its own blocks (gguf), anything else in float; gguf: keep a "
             "GGUF file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS) for the native "
             "kernels; none: "
             "dequantize to --dtype (the float reference); int8: int8 GEMMs for every linear layer (CPU, fbgemm); "
             "int4: 4-bit blocks for every linear layer, quantized at load. awq/gptq/fp8 checkpoints cannot be "
             "read")
    # CUDA: decode-only steps replay graphs captured per batch size (worker/cuda_graphs.py); this runs every
    # step eagerly instead (as vLLM's --enforce-eager does). Other devices always run eagerly.
    enforce_eager: bool = setting(
        False, help="CUDA: run every step eagerly instead of replaying decode steps as CUDA graphs captured per "
                    "batch size (other devices always run eagerly)")
    # Which attention backend runs (model/attention/): auto, torch, cpu-native or triton.
    attention_backend: str = setting(
        "auto", choices=ATTENTION_BACKENDS,
        help="auto: cpu-native on the CPU when the native kernels build and the dtypes fit, triton on CUDA when "
             "triton is installed, else torch (SDPA over gathered blocks, runs anywhere)")
    # The same request gives the same answer whatever shares its steps (docs/architecture.md, "Batch
    # invariance"): on by default. Off only frees attention's unshared AVX-512 forms and AMX's tiles, which do
    # not compute a row the same way in every cut of a step; on AVX2 CPUs it changes nothing.
    batch_invariant: bool = setting(
        True, help="a request's tokens do not depend on its batch-mates, prefix-cache hits or chunking (CPU: "
                   "attention takes only the forms decode and prefill share, the products stay below AMX; "
                   "--no-batch-invariant lets AVX-512 and AMX CPUs take their faster, batch-dependent forms)")
    # How /v1/embeddings (and LLM.embed) pool a prompt's hidden states (tideserve/pooling_params.py).
    pooler_config: PoolerConfig | dict | str | None = setting(
        None, metavar="JSON", aliases=("--override-pooler-config",),
        help='embeddings: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true|false} (default LAST, '
             'normalized, as vLLM\'s embed task)')

    # vLLM's: LLM.sleep / POST /sleep release the weights and the KV pool of an idle engine (docs/api.md).
    enable_sleep_mode: bool = setting(
        False, help="allow LLM.sleep() and POST /sleep?level=1|2: an idle engine releases its KV pool and its "
                    "weights (level 1 keeps a host copy where the device is a GPU; level 2 reloads them from the "
                    "model file on wake)")
    # vLLM's engine argument: the most alternatives per token a request's logprobs may ask for.
    max_logprobs: int = setting(
        20, help="largest logprobs / top_logprobs / prompt_logprobs a request may ask for")
    # vLLM's weight offloading (GiB of weights kept in host memory). tideserve keeps every weight where the
    # model computes: on the CPU that changes nothing (a warning), on a GPU it could decide whether a model
    # fits, so the engine refuses to start (engine/builder.py check_cpu_offload).
    cpu_offload_gb: float = setting(
        0.0, help="vLLM's weight offloading to host memory, which tideserve does not do: refused at start-up on "
                  "a GPU (the error says what to do instead), ignored with a warning on the CPU, whose weights "
                  "are host memory already")

    def __post_init__(self) -> None:
        self.pooler_config = parse_pooler_config(self.pooler_config)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}.")
        if (isinstance(self.cpu_offload_gb, bool) or not isinstance(self.cpu_offload_gb, int | float)
                or not self.cpu_offload_gb >= 0):
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {self.cpu_offload_gb!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}.")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or half, float), got {self.dtype!r}.")
        self.quantization = _check_quantization(self.quantization)
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}.")


def _check_quantization(method: str | None) -> str:
    """The quantization to run; None (vLLM's default) means "auto": the weights as the file stores them."""
    if method is None:
        return "auto"
    if method in QUANTIZATIONS:
        return method
    if method in VLLM_CHECKPOINT_QUANTIZATIONS:
        raise ValueError(
            f"quantization={method!r} is not supported: tideserve cannot read {method} checkpoints. It reads GGUF "
            "files (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS/F16/BF16/F32) and float "
            "safetensors, and quantizes float weights itself at load: use a GGUF export of the model, or its "
            "float weights with quantization='int8' or 'int4' (--quantization int8|int4).")
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}.")


@dataclass
class ParallelConfig:
    """How many devices one engine spans, and whether its CPU threads follow the machine. Tensor
    parallelism splits one model across ``tensor_parallel_size`` ranks (one process each, worker/); the
    pipeline and data-parallel sizes exist so vLLM's scripts get an explanation instead of an
    unknown-argument error."""

    tensor_parallel_size: int = setting(
        1, aliases=("-tp",),
        help="split the model across this many ranks, one process each (heads, MLP and vocabulary sharded; gloo on "
             "CPU, NCCL on CUDA; float weights only)")
    pipeline_parallel_size: int = setting(1, aliases=("-pp",), help="only 1 (not implemented yet)")
    data_parallel_size: int = setting(
        1, aliases=("-dp",), help="only 1: run one server per device behind a load balancer instead")
    # CPU: follow the cores actually free (see engine/threads.py); read by the engine from EngineArgs
    adaptive_threads: bool = setting(
        True, bool_flags="no", help="keep the intra-op thread count fixed even when other processes take cores")
    # vLLM's name: a class whose methods join the worker's on every rank (LLM.collective_rpc calls them)
    worker_extension_cls: str | None = setting(
        None, metavar="MODULE.CLASS",
        help="a class (package.module.Class) whose methods are added to the worker on every rank, called with "
             "LLM.collective_rpc")

    def __post_init__(self) -> None:
        for name, flag, what in (
                ("tensor_parallel_size", "--tensor-parallel-size/-tp", ""),
                ("pipeline_parallel_size", "--pipeline-parallel-size/-pp", "Pipeline parallelism"),
                ("data_parallel_size", "--data-parallel-size/-dp", "Data parallelism inside one server")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
            if value > 1 and what:
                raise ValueError(
                    f"{name}={value} ({flag} {value}): {what} is not implemented in tideserve yet; use "
                    f"{name}=1. For more throughput run one tideserve server per device (e.g. "
                    "CUDA_VISIBLE_DEVICES=N tideserve serve ... --port 800N) behind a load balancer; for a model "
                    "too large for one device, use --tensor-parallel-size N, a quantized GGUF file of it (e.g. "
                    "Q4_K) or --quantization int4.")


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
