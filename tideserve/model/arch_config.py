"""The model's shape and numerics, read once from an HF config.json or GGUF metadata.

One dataclass serves both formats so that the model and the runner never look at either format directly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tideserve.core.kv_cache.groups import KVCacheGroups
from tideserve.model.registry import family_for, hf_architecture_for_gguf, hf_architecture_for_model_type

if TYPE_CHECKING:
    from tideserve.model.loader.gguf_index import GGUFIndex

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("llama3", "linear", "longrope")


@dataclass
class ArchConfig:
    """Decoder-only transformer hyper-parameters (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3, Phi-3/Phi-4,
    Gemma 2/3; mixtures of experts: Mixtral, Qwen3-MoE).


    The keys every family shares are read here; what a family derives its own way (biases, tied
    embeddings, q/k norms) comes from its ``ModelFamily`` declaration (``tideserve/model/families/``).

    ``rope_scaling`` is None for plain RoPE, else a dict with ``rope_type`` in ("llama3", "linear",
    "longrope") and that type's HF parameters, or ``rope_type == "freq_factors"`` with a per-frequency
    divisor list (how llama.cpp stores llama3 scaling in GGUF: the ``rope_freqs`` tensor). A longrope dict
    always carries its ``attention_factor`` (HF's default computed here when the config has none).

    ``rotary_dim``: how many values of each head rotate (HF ``partial_rotary_factor`` * head_dim, GGUF
    ``rope.dimension_count``); None means the whole head.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj; Qwen2 does not
    # Qwen3: an RMSNorm over each q and k head (weights [head_dim], eps rms_norm_eps) before rotary
    qk_norm: bool = False
    rotary_dim: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): a layer's MLP is ``num_experts`` SwiGLU experts of
    # ``moe_intermediate_size``, of which a router picks ``num_experts_per_tok`` per token; 0 experts is a
    # dense model. ``dense_layers`` keep a dense MLP of ``intermediate_size`` (Qwen3-MoE's mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral always does)
    dense_layers: tuple[int, ...] = ()
    # Gemma 2/3 (families/gemma2.py, gemma3.py); the defaults are every other family's behaviour.
    # A sliding layer's query at position p attends keys p - sliding_window + 1 .. p; ``sliding_layers[i]``
    # says whether layer i is one (None: no layer is).
    sliding_window: int | None = None
    sliding_layers: list[bool] | None = None
    rope_local_theta: float | None = None  # the sliding layers' rotary base, unscaled (None: rope_theta's)
    query_pre_attn_scalar: float | None = None  # attention scale = its ** -0.5 (None: head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) before the softmax
    final_logit_softcapping: float | None = None  # the same on the logits
    # Gemma's RMSNorm multiplies by (norm_weight_offset + w): HF checkpoints store w (offset 1), llama.cpp
    # stores 1 + w (offset 0), so each keeps its own numbers exactly.
    norm_weight_offset: float = 0.0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        family_for(self.architecture)  # unknown architecture -> ValueError listing supported
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        self.rotary_dim = self.rotary_dim or self.head_dim
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and at most head_dim={self.head_dim}")
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_experts={self.num_experts}")
        self.dense_layers = tuple(sorted(self.dense_layers))
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_hidden_layers:
            raise ValueError(f"{len(self.sliding_layers)} sliding_layers entries for "
                             f"{self.num_hidden_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` attends, itself included; 0 for the whole context."""
        if self.sliding_window and self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return 0

    def kv_cache_groups(self) -> KVCacheGroups:
        """How the KV cache groups the layers (core/kv_cache/groups.py): one group unless local and global
        layers are mixed (Gemma 2/3), then groups of equal size each holding one kind."""
        return KVCacheGroups.from_windows([self.layer_window(i) for i in range(self.num_hidden_layers)])

    @property
    def generates(self) -> bool:
        """False for a headless checkpoint (``LlamaModel``, ``Qwen2Model``, ...): an embedding model's
        transformer saved without its language-model head, which serves embeddings only."""
        return not self.architecture.endswith("Model")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ArchConfig:
        """Build from a parsed config.json (transformers v4 ``rope_theta``/``rope_scaling`` or v5
        ``rope_parameters``)."""
        archs = config.get("architectures") or []
        if not archs:
            model_type = config.get("model_type", "")
            archs = [hf_architecture_for_model_type(model_type) or model_type or "<missing>"]
        architecture = archs[0]
        family = family_for(architecture)
        if config.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        if config.get("use_sliding_window"):
            logger.warning("config.json use_sliding_window=true is ignored: attention spans the full context")

        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        rope_theta, rope_scaling = _hf_rope(config)
        # transformers v5 keeps partial_rotary_factor beside rope_theta; v4 configs at the top level
        partial = float((rope_scaling or {}).pop("partial_rotary_factor", None)
                        or config.get("partial_rotary_factor") or 1.0)
        if rope_scaling and "original_max_position_embeddings" not in rope_scaling:
            # Phi-3 keeps the pre-training context at the top level, beside max_position_embeddings
            rope_scaling["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                                                or config.get("max_position_embeddings"))
        eos = config.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = config.get("bos_token_id")
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            # A headless checkpoint has no LM head: the embedding table stands in for the logits that the
            # profiling pass and an embedding request's discarded sample compute.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) or architecture.endswith("Model"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )
        return cls(**{**fields, **family.hf_config_fields(config)})

    @classmethod
    def from_gguf_metadata(cls, index: GGUFIndex) -> ArchConfig:
        """Build from a GGUF file's key/value metadata (and its tensor list, for the vocab size, tied
        embeddings and llama3 rope factors)."""
        gguf_arch = index.get("general.architecture")
        if gguf_arch is None:
            raise ValueError("GGUF file has no general.architecture metadata")
        architecture = hf_architecture_for_gguf(str(gguf_arch))
        family = family_for(architecture)

        def get(key: str, default: Any = None) -> Any:
            value = index.get(key.format(arch=gguf_arch))
            return default if value is None else value

        def need(key: str) -> Any:
            value = get(key)
            if value is None:
                raise ValueError(f"GGUF metadata {key.format(arch=gguf_arch)!r} is missing")
            return value

        tensors = {t.name: t for t in index.tensors}
        hidden = int(need("{arch}.embedding_length"))
        num_heads = int(need("{arch}.attention.head_count"))
        embd = tensors.get("token_embd.weight")
        tokens = index.get("tokenizer.ggml.tokens")
        if embd is not None:
            vocab_size = int(embd.shape[-1])  # GGUF shapes are [in, out]: [hidden, vocab]
        elif tokens is not None:
            vocab_size = len(tokens)
        else:
            vocab_size = int(need("{arch}.vocab_size"))

        rope_scaling: dict[str, Any] | None = None
        scaling_type = get("{arch}.rope.scaling.type")
        if "rope_freqs.weight" in tensors:
            factors = tensors["rope_freqs.weight"].read_array()
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors.ravel()]}
        elif "rope_factors_long.weight" in tensors:  # llama.cpp's Phi-3 longrope: the factors as tensors
            rope_scaling = {
                "rope_type": "longrope",
                "long_factor": [float(f) for f in tensors["rope_factors_long.weight"].read_array().ravel()],
                "short_factor": [float(f) for f in tensors["rope_factors_short.weight"].read_array().ravel()],
                "original_max_position_embeddings": int(need("{arch}.rope.scaling.original_context_length")),
            }
            attn_factor = get("{arch}.rope.scaling.attn_factor")
            if attn_factor is not None:
                rope_scaling["attention_factor"] = float(attn_factor)
        elif scaling_type not in (None, "none"):
            factor = float(get("{arch}.rope.scaling.factor", 1.0))
            rope_scaling = {"rope_type": str(scaling_type), "factor": factor}

        eos_ids: list[int] = []
        for kind in ("eos", "eot", "eom"):  # llama 3 ends turns with eot
            value = get(f"tokenizer.ggml.{kind}_token_id")
            if value is not None and int(value) not in eos_ids:
                eos_ids.append(int(value))
        bos = get("tokenizer.ggml.bos_token_id")
        head_count_kv = get("{arch}.attention.head_count_kv", num_heads)
        head_dim = int(get("{arch}.attention.key_length", hidden // num_heads))
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(need("{arch}.feed_forward_length")),
            num_hidden_layers=int(need("{arch}.block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(head_count_kv),
            head_dim=head_dim,
            rotary_dim=int(get("{arch}.rope.dimension_count", head_dim)),
            rms_norm_eps=float(get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("{arch}.context_length", 2048)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )
        fields.update(_gguf_moe_fields(get, tensors.keys(), fields))
        return cls(**{**fields, **family.gguf_config_fields(tensors.keys()), **family.gguf_metadata_fields(get)})


def _gguf_moe_fields(get: Any, tensors: Collection[str], fields: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF file (none for a dense one). llama.cpp writes the expert
    count and top-k under every architecture's prefix; the expert MLP size only where it differs from
    ``feed_forward_length`` (qwen3moe); a renormalisation flag for some architectures (qwen3moe always
    renormalises: its released models all do). A layer without a router tensor is dense."""
    experts = int(get("{arch}.expert_count", 0))
    if not experts:
        return {}
    layers = fields["num_hidden_layers"]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(get("{arch}.expert_used_count", 0)),
        "moe_intermediate_size": int(get("{arch}.expert_feed_forward_length", fields["intermediate_size"])),
        "norm_topk_prob": bool(get("{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors),
    }


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers config layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), dict(scaling) if scaling else None


def _normalize_rope_scaling(scaling: dict[str, Any] | None, max_positions: int) -> dict[str, Any] | None:
    """None for plain RoPE; else a dict whose ``rope_type`` we implement (unknown types raise).
    ``max_positions``: the model's context, from which longrope's default attention factor follows."""
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "su":  # LongRoPE's first name, in early Phi-3 128k configs
        rope_type = "longrope"
    if rope_type == "default":
        return None
    if rope_type == "freq_factors":
        return {"rope_type": rope_type, **scaling}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }[rope_type]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} is missing {', '.join(missing)}")
    if rope_type == "longrope" and scaling.get("attention_factor") is None:
        scaling["attention_factor"] = _longrope_attention_factor(scaling, max_positions)
    return {"rope_type": rope_type, **scaling}


def _longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """transformers' default: sqrt(1 + ln(s) / ln(original)) for the context scale s = ``factor``, or, as
    Phi-3 configs have none, max_position_embeddings / original_max_position_embeddings."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
