"""The whole-step native decode (model/native_decode.py) against the Python layer loop over the same
kernels: equal outputs, bit for bit, on tiny random Llama (GQA), Qwen2 (qkv bias) and Qwen3 (per-head q/k
norms, head_dim not hidden / heads; with and without its q/k/v/o biases) models, with float32, bfloat16
and fp8 (e4m3) caches; and the cases it must leave to the Python path."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen3

from tideserve import native
from tideserve.model.layers.quant.transform import quantize_model
from tideserve.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")


KINDS = ["llama", "qwen2", "qwen3", "qwen3-bias"]


def tiny(kind: str = "llama") -> LlamaForCausalLM:
    if kind.startswith("qwen3"):
        return tiny_qwen3(bias=kind == "qwen3-bias", num_layers=3, scale=0.1)
    return tiny_llama(qwen2=kind == "qwen2", num_layers=3, scale=0.1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", KINDS)
def test_native_decode_equals_the_python_layer_loop(kind, kv_dtype, mixed_batch):
    qmodel, _ = quantize_model(tiny(kind), "int4", torch.device("cpu"))
    fast = qmodel.native_decode
    assert fast is not None
    calls: list[bool] = []
    qmodel.native_decode = lambda *a: calls.append(fast(*a)) or calls[-1]
    # dtype: the cache's
    with_native = mixed_batch(qmodel.arch.vocab_size).ours(qmodel, dtype=kv_dtype, backend="cpu-native")
    # Steps 1 and 2 hold prefills (Python path); step 3 is all decodes (one native call).
    assert calls == [False, False, True]
    qmodel.native_decode = None
    runs = [with_native, mixed_batch(qmodel.arch.vocab_size).ours(qmodel, dtype=kv_dtype, backend="cpu-native")]
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


def test_a_copied_model_does_not_share_the_native_forward():
    qmodel, _ = quantize_model(tiny(), "int4", torch.device("cpu"))
    assert qmodel.native_decode is not None
    assert copy.deepcopy(qmodel).native_decode is None  # it would point at the original's weights


def test_native_decode_is_only_built_for_block_quantized_float32_models():
    model = tiny()
    assert not model.enable_native_decode()  # float weights
    int8, _ = quantize_model(model, "int8", torch.device("cpu"))
    assert int8.native_decode is None
    assert quantize_model(model.to(torch.bfloat16), "int4", torch.device("cpu"))[0].native_decode is None


def test_timing_the_phases_changes_no_number_and_accounts_every_phase(mixed_batch):
    """profile_decode.py reads where a native step's time goes from the call itself: turning that on must
    leave the outputs bit for bit, and every phase must have run (its clock moved) in the decode step."""
    from tideserve.model.native_decode import PHASES

    qmodel, _ = quantize_model(tiny(), "int4", torch.device("cpu"))
    plain = mixed_batch(qmodel.arch.vocab_size).ours(qmodel, dtype=torch.bfloat16, backend="cpu-native")
    assert qmodel.native_decode.phase_seconds() == {}  # off by default
    qmodel.native_decode.time_phases()
    timed = mixed_batch(qmodel.arch.vocab_size).ours(qmodel, dtype=torch.bfloat16, backend="cpu-native")
    for got, want in zip(timed, plain, strict=True):
        assert torch.equal(got, want)
    seconds = qmodel.native_decode.phase_seconds()
    assert list(seconds) == list(PHASES) and all(s > 0 for s in seconds.values()), seconds
    qmodel.native_decode.time_phases(False)
    assert qmodel.native_decode.phase_seconds() == {}
