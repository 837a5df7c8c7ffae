"""One row's product does not depend on how many rows share the call (qgemm.c's dispatcher picks the row
kernels, the matrix-vector kernel or the tiles by the number of rows): every kernel a batch size can
select computes a row with the same float operations in the same order, so a row's output is bit-identical
whether it is computed alone, in a handful of rows or in a large batch. This is what lets a request get
the same tokens whatever shares its steps and however much of its prompt the prefix cache held.

Checked on every ISA path this CPU runs (the others are skipped by name), every format, both layouts, with
and without SwiGLU, over every batch size up to past each format's tile threshold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import quantized_pair

from tideserve.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")

FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
X8_FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"]
PATHS = ["scalar", "avx2", "avx512", "amx"]
K = 512
LARGEST = 48  # past every path's threshold between the row kernels / matrix-vector kernel and the tiles


def need(path: str) -> None:
    if quant.ISA_NAMES.index(quant.cpu_isa()) < quant.ISA_NAMES.index(path):
        pytest.skip(f"this CPU has no {path} path (best: {quant.cpu_isa()})")


def layer(qtype: str, layout: str, n: int = 100, k: int = K) -> quant.QMat:
    """n output rows: whole groups of 8 for the matrix-vector kernel and a remainder of 4 for the row
    kernels, as an odd-sized layer has."""
    gen = np.random.default_rng(7)
    w = (gen.standard_normal((n, k)) * np.linspace(0.05, 2.0, k)).astype(np.float32)
    data, _ = quantized_pair(torch.from_numpy(w), qtype)
    stored = data if layout == "rows" else quant.relayout(qtype, data, k, layout)
    bias = torch.linspace(-1, 1, n)
    return quant.make_qmat([(qtype, stored)], k, bias, [layout])


def assert_rows_independent_of_batch(mat: quant.QMat, width: int, swiglu: bool = False) -> None:
    x = torch.randn(LARGEST, width, generator=torch.Generator().manual_seed(3)) * 2
    x[5] *= 100  # rows of very different magnitudes share the batch
    full = quant.qmatmul(x, mat, swiglu=swiglu)
    for m in range(1, LARGEST):
        part = quant.qmatmul(x[:m], mat, swiglu=swiglu)
        differ = sorted(set((part != full[:m]).nonzero()[:, 0].tolist()))
        assert not differ, f"{m} rows: row(s) {differ} differ from the {LARGEST}-row batch"
    for i in (0, 5, 17, LARGEST - 1):  # a row alone, wherever it sat in the batch
        assert torch.equal(quant.qmatmul(x[i:i + 1].contiguous(), mat, swiglu=swiglu)[0], full[i]), f"row {i} alone"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("qtype", "layout"), [*((q, "rows") for q in FORMATS), *((q, "x8") for q in X8_FORMATS)])
def test_a_row_gives_the_same_bits_in_every_batch_size(path, qtype, layout):
    need(path)
    mat = layer(qtype, layout)
    with quant.forced_isa(path):
        kernels = {quant.kernel_for(m, qtype) for m in range(1, LARGEST + 1)}
        assert_rows_independent_of_batch(mat, K)
    if path != "scalar":
        assert len(kernels) > 1, f"{path} chose one kernel for every batch size: {kernels}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", ["q4_1", "q6_k", "q2_k", "iq4_xs"])
def test_swiglu_rows_give_the_same_bits_in_every_batch_size(path, qtype):
    need(path)
    mat = layer(qtype, quant.preferred_layout(qtype))
    with quant.forced_isa(path):
        assert_rows_independent_of_batch(mat, 2 * K, swiglu=True)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_gives_the_same_bits_over_mixed_segments(path):
    """A fused projection (qkv) whose segments are in different formats: each segment picks its kernel by
    its own format's threshold, or the whole layer takes the tiles."""
    need(path)
    gen = np.random.default_rng(11)
    segments = []
    for qtype, n in (("q4_k", 64), ("q8_0", 24), ("q6_k", 40), ("q3_k", 24)):  # Q3_K: no interleaved layout
        w = (gen.standard_normal((n, K))).astype(np.float32)
        data, _ = quantized_pair(torch.from_numpy(w), qtype)
        segments.append((qtype, data if qtype == "q3_k" else quant.relayout(qtype, data, K, "x8")))
    mat = quant.make_qmat(segments, K, None, ["x8"] * 3 + ["rows"])
    with quant.forced_isa(path):
        assert_rows_independent_of_batch(mat, K)
