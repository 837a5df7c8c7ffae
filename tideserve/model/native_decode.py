"""A whole decode step's decoder layers in one native call (tideserve/native/decode_forward.c).

Why: with 4-bit weights a batch-1 step streams about 100 MB of weights, a dozen milliseconds on a small
CPU, and the per-layer Python calls around the kernels cost several more: each takes tens of
microseconds once the weights have pushed the interpreter's data out of the caches. The native loop
calls the very kernels the Python path calls, in the same order, so both give the same numbers; the
Python path remains for prefills, other dtypes and other quantizations.
"""

from __future__ import annotations

import ctypes

import torch

from tideserve import native
from tideserve.model.attention import AttentionMetadata, CpuNativeMetadata
from tideserve.model.layers.quant.weights import QuantWeight
from tideserve.native.quant import QMat


class _Layer(ctypes.Structure):
    """ts_decoder_layer (tideserve_native.h); q_norm and k_norm are NULL for a model without q/k norms."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", QMat),
                ("o", QMat), ("gate_up", QMat), ("down", QMat), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)]


def _qweight(linear: torch.nn.Module) -> QMat | None:
    q = linear.qweight
    return q.mat if isinstance(q, QuantWeight) else None


def _plain_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


# The phases the native call can time, in the order of TS_PHASE_* (tideserve_native.h).
PHASES = ("norms", "qkv", "rope_store", "attention", "o", "gate_up", "down")


class NativeDecodeForward:
    """Runs the decoder layers of a block-quantized float32 Llama-family model (Qwen3's q/k norms and Phi-3's
    partial rotary included) for decode-only steps.

    Holds raw pointers to the model's weights: it must not outlive them, and the model must not be
    re-quantized or moved while it is in use (the model owns it, so both go together).
    """

    def __init__(self, lib: ctypes.CDLL, model: torch.nn.Module, layers: ctypes.Array) -> None:
        self.lib = lib
        self.model = model
        self.layers = layers  # kept alive: the kernel reads it through layers_ptr
        self.layers_ptr = ctypes.cast(layers, ctypes.c_void_p)
        self._cache_arrays: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None
        self._phase_seconds: ctypes.Array | None = None  # accumulated per phase while timing is on
        # The kernel attends every cached key: with a sliding window (Phi-3's, on every layer) it serves the
        # steps whose contexts all fit the window, where the window masks nothing.
        windows = [model.arch.layer_window(i) for i in range(model.arch.num_hidden_layers)]
        self.window = min((w for w in windows if w), default=0)

    def time_phases(self, on: bool = True) -> None:
        """Start (from zero) or stop timing the call's phases; a profiler sees the call as one function."""
        self._phase_seconds = (ctypes.c_double * len(PHASES))() if on else None

    def phase_seconds(self) -> dict[str, float]:
        """Wall seconds per phase (``PHASES``) since ``time_phases()``; empty when timing is off."""
        return dict(zip(PHASES, self._phase_seconds, strict=True)) if self._phase_seconds is not None else {}

    def __deepcopy__(self, memo: dict) -> None:
        """A copied model gets no native forward: this one points at the original's weights."""
        return None

    @classmethod
    def build(cls, model: torch.nn.Module) -> NativeDecodeForward | None:
        """The native forward for ``model``, or None when its layers are not all block-quantized, float32
        and laid out as the kernel expects (or no native library could be built). A mixture-of-experts
        model is refused: the kernel runs one dense MLP per layer, so its layers take the Python path."""
        lib = native.load_library()
        if lib is None or getattr(model, "dtype", None) != torch.float32 or model.arch.num_experts:
            return None
        if not getattr(model, "native_decode_layers", False):
            return None  # the kernel runs Llama's layers exactly (Gemma's norms, MLP and windows differ)
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = [_qweight(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.q_norm is not None:
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            if any(w is None for w in weights) or not all(_plain_f32(n) for n in norms):
                return None
            qk_norms = [n.data_ptr() for n in norms[2:]] or [None, None]
            layers.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *weights, *qk_norms))
        if not _plain_f32(model.model.norm.weight):
            return None
        return cls(lib, model, (_Layer * len(layers))(*layers))

    def _caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """Pointers to arrays of the layers' cache pointers, rebuilt only when the pool has reallocated."""
        ptrs = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._cache_arrays is None or self._cache_arrays[0] != ptrs:
            array = ctypes.c_void_p * len(kv_caches)
            self._cache_arrays = (ptrs, array(*ptrs[0::2]), array(*ptrs[1::2]))
        return (ctypes.cast(self._cache_arrays[1], ctypes.c_void_p),
                ctypes.cast(self._cache_arrays[2], ctypes.c_void_p))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> bool:
        """Replace ``hidden`` (the step's embeddings, [T, hidden]) by the final-normed hidden states. False,
        touching nothing, when the step is not a plain decode step the kernel can take."""
        tokens = hidden.shape[0]
        if not isinstance(meta, CpuNativeMetadata):  # the kernel reads the CPU backend's tables and lengths
            return False
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping
        if (meta.prefills or meta.num_decode_tokens != tokens or tokens == 0 or tables is None or lens is None
                or (self.window and int(lens.max()) > self.window)
                or not _plain_f32(hidden) or not _plain_f32(cos) or not _plain_f32(sin)
                or not all(t.dtype == torch.int64 and t.is_contiguous() for t in (tables, lens, slots))):
            return False
        k0 = kv_caches[0][0]
        if k0.dtype not in native.CACHE_DTYPE_CODES or not all(
                k.dtype == v.dtype == k0.dtype and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return False
        arch = self.model.arch
        attn = self.model.model.layers[0].self_attn
        k_ptrs, v_ptrs = self._caches(kv_caches)
        failed = self.lib.ts_decode_forward_f32(
            self.layers_ptr, k_ptrs, v_ptrs, len(kv_caches), hidden.data_ptr(), self.model.model.norm.weight.data_ptr(),
            tokens, arch.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, self.model.rotary.rotary_dim,
            arch.intermediate_size,
            arch.rms_norm_eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(),
            k0.shape[1], native.CACHE_DTYPE_CODES[k0.dtype], attn.scale, native.intra_op_threads(),
            self._phase_seconds)
        return failed == 0
