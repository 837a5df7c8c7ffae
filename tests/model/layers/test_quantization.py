"""int8 and int4 linear layers: close to float, per-token (so batch-mates cannot change a row), and
quantizing a model leaves the float one untouched."""

from __future__ import annotations

import pytest
import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.layers.linear import Linear
from tideserve.model.layers.quant.methods import int8_unavailable_reason, unavailable_reason
from tideserve.model.layers.quant.transform import quantize_model
from tideserve.model.layers.quant.weight_bytes import model_weight_bytes
from tideserve.model.layers.quant.weights import Int8Weight, QuantWeight
from tideserve.model.llama import LlamaForCausalLM
from tideserve.native import quant

pytestmark = pytest.mark.skipif(int8_unavailable_reason(torch.device("cpu")) is not None,
                                reason="this torch build has no fbgemm/x86 quantized engine")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_to_float(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) / 8
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(5, 7, 64, generator=g)
    ref = torch.nn.functional.linear(x, w, b)
    out = Int8Weight(w, b)(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 0.02


def test_each_row_is_quantized_alone():
    """A batch-mate with huge activations must not coarsen the other rows (per-tensor scaling would)."""
    g = torch.Generator().manual_seed(1)
    q = Int8Weight(torch.randn(32, 48, generator=g))
    row = torch.randn(1, 48, generator=g)
    loud = torch.randn(3, 48, generator=g) * 1000
    assert torch.equal(q(row), q(torch.cat([loud[:2], row, loud[2:]]))[2:3])


def test_smoothing_keeps_the_product():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(6, 24, generator=g)
    x[:, 3] *= 50  # an outlier channel, the case smoothing is for
    smooth = (x.abs().amax(0) ** 0.7 / w.abs().amax(0) ** 0.3)
    ref = x @ w.T
    assert rel_err(Int8Weight(w, smooth=smooth)(x), ref) < rel_err(Int8Weight(w)(x), ref)
    assert rel_err(Int8Weight(w, smooth=smooth)(x), ref) < 0.02


def tiny_llama() -> LlamaForCausalLM:
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(arch)
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_quantize_model_copies_and_leaves_the_float_model_alone():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qmodel, saved = quantize_model(model, "int8", torch.device("cpu"))
    assert qmodel is not model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(m.qweight is None for m in model.modules() if isinstance(m, Linear))
    assert all(m.qweight is not None and m.weight is None for m in qmodel.modules() if isinstance(m, Linear))
    # Norms and embeddings are shared, not copied.
    assert qmodel.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert model_weight_bytes(qmodel) < model_weight_bytes(model) + qmodel.lm_head_q.nbytes
    assert saved > 0
    hidden = torch.randn(3, 64)
    assert rel_err(qmodel.compute_logits(hidden), model.compute_logits(hidden)) < 0.03


def test_quantize_model_rejects_what_it_cannot_do():
    model = tiny_llama()
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8, int4, got 'int2'"):
        quantize_model(model, "int2", torch.device("cpu"))
    with pytest.raises(ValueError, match="does not run on cuda"):
        quantize_model(model, "int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="does not run on cuda"):
        quantize_model(model, "int4", torch.device("cuda"))
    assert quantize_model(model, "none", torch.device("cpu")) == (model, 0)
    with pytest.raises(ValueError, match="applied while the file loads"):
        quantize_model(model, "gguf", torch.device("cpu"))


@pytest.mark.skipif(unavailable_reason("int4", torch.device("cpu")) is not None, reason="no native kernels")
def test_int4_model_uses_4_bit_layers_and_an_8_bit_head_and_keeps_rows_independent():
    model = tiny_llama()
    qmodel, saved = quantize_model(model, "int4", torch.device("cpu"))
    layers = [m.qweight for m in qmodel.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(q, QuantWeight) and q.qtypes == ["q4_1"] for q in layers)
    assert isinstance(qmodel.lm_head_q, QuantWeight) and qmodel.lm_head_q.qtypes == ["q8_0"]
    assert saved > 0
    hidden = torch.randn(5, 64)
    assert rel_err(qmodel.compute_logits(hidden), model.compute_logits(hidden)) < 0.03
    mlp = qmodel.model.layers[0].mlp
    assert rel_err(mlp(hidden), model.model.layers[0].mlp(hidden)) < 0.2  # 4-bit weights, two layers deep
    # Each row is quantized on its own: a row's output does not depend on its batch-mates, bit for bit
    # within one kernel (1, 3 and 5 rows take the same one: AVX2's matrix-vector kernel on AVX2 CPUs) ...
    loud = torch.randn(4, 64) * 100
    assert torch.equal(mlp(hidden)[2:3], mlp(torch.cat([loud[:2], hidden[2:3], loud[2:]]))[2:3])
    assert torch.equal(mlp(hidden[2:3]), mlp(torch.cat([loud[:1], hidden[2:3], loud[1:2]]))[1:2])
    # ... and, one layer, up to the float summation order across kernels (16 rows: the tiles), or, where 16
    # rows take the AMX tiles (bfloat16 activations instead of int8 blocks), up to that rounding. Through the
    # whole MLP an order difference can move one int8 code of the next layer's activations (a step of
    # max|x| / 127): close, not to the last bits.
    many = torch.cat([hidden, torch.randn(11, 64)])
    proj = mlp.gate_up_proj
    if quant.kernel_for(16) == "amx-tiles":
        assert rel_err(proj(many)[2:3], proj(hidden[2:3])) < 0.02
    else:
        torch.testing.assert_close(proj(many)[2:3], proj(hidden[2:3]), rtol=1e-5, atol=1e-5)
    assert rel_err(mlp(many)[2:3], mlp(hidden[2:3])) < 0.02


def test_int4_reproduces_the_gguf_q4_1_weights(smollm2_gguf_path):
    """The embedded GGUF stores Q4_1 blocks; quantizing their dequantized values gives the same numbers."""
    import gguf

    from tideserve.model.loader.gguf import dequantize_tensor
    from tideserve.model.loader.gguf_index import read_gguf_index

    tensor = next(t for t in read_gguf_index(str(smollm2_gguf_path)).tensors if t.name == "blk.3.ffn_down.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    weight = dequantize_tensor(tensor)
    back = QuantWeight.from_float(weight, qtype="q4_1").dequantize()
    torch.testing.assert_close(back, weight, rtol=0, atol=1e-6 * float(weight.abs().max()))


@pytest.mark.skipif(unavailable_reason("int4", torch.device("cpu")) is not None, reason="no native kernels")
def test_int4_names_the_layer_it_cannot_block():
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.qkv_proj takes 48. Use --quantization int8"):
        quantize_model(LlamaForCausalLM(arch), "int4", torch.device("cpu"))
