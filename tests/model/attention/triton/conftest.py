"""The Triton kernels, loaded either for Triton's interpreter (CPU tensors) or compiled for CUDA, and a
builder of random paged KV caches for them.

``triton.jit`` decides at definition time whether a kernel is interpreted (``TRITON_INTERPRET``), and the
interpreter reads the variable again at launch, so it must be set while the kernel modules are imported
and while the kernels run. It is set here only around the import and for the duration of each test in this
directory, never for the rest of the suite (servers that other tests start inherit the environment).

Mode: ``TRITON_INTERPRET=1`` or ``0`` in the environment wins; otherwise compiled where CUDA is present,
interpreted elsewhere. Tests take a ``device`` parameter: "cpu" runs in interpreter mode, "cuda" (marked
``cuda``) in compiled mode; the other one is skipped with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

_EXPLICIT = os.environ.get("TRITON_INTERPRET")
INTERPRET = _EXPLICIT == "1" if _EXPLICIT in ("0", "1") else not torch.cuda.is_available()
_MODULES = ("_common", "paged_decode", "paged_prefill")
_PACKAGE = "tideserve.model.attention.triton"


def _load() -> tuple[ModuleType | None, str]:
    """Import (or re-import, if something imported them in the other mode) the kernel modules."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:  # no triton, or only a namespace directory of that name
        return None, "triton is not installed (pip install triton; Linux x86-64 wheels)"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if INTERPRET else "0"
    try:
        for name in (*(f"{_PACKAGE}.{m}" for m in _MODULES), _PACKAGE):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
        return sys.modules[_PACKAGE], ""
    except ImportError as e:
        return None, f"triton is not importable: {e}"
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _library_mode_matches() -> bool:
    """Triton's own library (``tl.zeros``, ``tl.sum``, ...) is decided in one mode when ``triton.language``
    is first imported, and the interpreter can only call it if that import was interpreted."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction) == INTERPRET


# Imported while this file is collected, before any test runs: transformers imports triton (compiled mode)
# as soon as a model is built, and a test module that builds one may run before these tests.
_MODULE, _REASON = _load()


@pytest.fixture(scope="session")
def triton_attention() -> ModuleType:
    """tideserve.model.attention.triton, its kernels defined for this run's mode."""
    if _MODULE is None:
        pytest.skip(_REASON)
    assert _library_mode_matches(), (
        "triton.language was imported before TRITON_INTERPRET was set for these tests, so its library "
        "functions cannot run in the interpreter; import triton from this conftest first")
    module, reason = _load()  # again, in case a test reloaded the kernel modules in the other mode
    if module is None:
        pytest.skip(reason)
    return module


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    """Where the kernels run: "cpu" through the interpreter, "cuda" compiled."""
    if request.param == "cpu" and not INTERPRET:
        pytest.skip("kernels are compiled for CUDA in this run; TRITON_INTERPRET=1 runs them on CPU")
    if request.param == "cuda" and INTERPRET:
        pytest.skip("kernels are interpreted in this run (no CUDA, or TRITON_INTERPRET=1)")
    return request.param


@dataclass(frozen=True)
class Shape:
    """One case's heads, sizes and dtypes. ``strided``: q and out are row slices of wider (fused-QKV-like)
    tensors, as the model hands them over."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    index_dtype: torch.dtype = torch.int32
    strided: bool = False


@dataclass
class PagedKV:
    """A paged KV cache whose unwritten slots hold NaN, so a kernel that reads a position past a context
    (or a padded block-table entry) produces NaN instead of a plausible number; and the queries."""

    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks], padded with the poisoned block 0
    context_lens: torch.Tensor  # [S]
    q: torch.Tensor  # [rows, H, D]
    out: torch.Tensor  # zeros like q
    scale: float

    def keys(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence s's keys and values gathered from its blocks, each KV head repeated for the query heads
        of its group: [context_len, num_heads, D] each, float32, on the CPU."""
        n = int(self.context_lens[s])
        block_size, num_kv_heads = self.k_cache.shape[1], self.k_cache.shape[2]
        blocks = self.block_tables[s, : -(-n // block_size)].long()
        k = self.k_cache[blocks].flatten(0, 1)[:n].float().cpu()
        v = self.v_cache[blocks].flatten(0, 1)[:n].float().cpu()
        group = self.q.shape[1] // num_kv_heads
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def _queries(rows: int, shape: Shape, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    heads, dtype = shape.num_heads, shape.q_dtype
    if shape.strided:
        q = torch.randn(rows, heads + 2 * shape.num_kv_heads, shape.head_dim).to(dtype).to(device)[:, :heads]
        out = torch.zeros(rows, heads + 1, shape.head_dim, dtype=dtype, device=device)[:, 1:]
    else:
        q = torch.randn(rows, heads, shape.head_dim).to(dtype).to(device)
        out = torch.zeros(rows, heads, shape.head_dim, dtype=dtype, device=device)
    return q, out


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory: a cache holding ``context_lens`` tokens per sequence in shuffled, non-contiguous blocks,
    and ``rows`` queries; ``fields``: a :class:`Shape`'s."""

    def build(context_lens: Sequence[int], rows: int, device: str, seed: int = 0, **fields: object) -> PagedKV:
        shape = Shape(**fields)  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(seed)
        block_size, kv_heads, head_dim = shape.block_size, shape.num_kv_heads, shape.head_dim
        per_seq = [-(-n // block_size) for n in context_lens]
        num_blocks = 1 + sum(per_seq)  # block 0 stays poisoned and pads every table
        k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
        v_cache = torch.full_like(k_cache, float("nan"))
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables = torch.zeros((len(context_lens), max(per_seq + [1]) + 2), dtype=torch.int64)
        for s, (n, nb) in enumerate(zip(context_lens, per_seq)):
            blocks, order = order[:nb], order[nb:]
            tables[s, :nb] = torch.tensor(blocks, dtype=torch.int64)
            pos = torch.arange(n)
            slots = tables[s, pos // block_size] * block_size + pos % block_size
            k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn((n, kv_heads, head_dim), generator=gen)
            v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn((n, kv_heads, head_dim), generator=gen)
        q, out = _queries(rows, shape, device)
        return PagedKV(k_cache.to(shape.kv_dtype).to(device), v_cache.to(shape.kv_dtype).to(device),
                       tables.to(shape.index_dtype).to(device),
                       torch.tensor(list(context_lens), dtype=shape.index_dtype, device=device), q, out,
                       head_dim ** -0.5)

    return build


@pytest.fixture
def cuda_device() -> str:
    """For the CUDA-sized cases: compiled kernels on a real GPU (the ``cuda`` marker skips them elsewhere)."""
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs the kernels compiled for CUDA (a GPU, TRITON_INTERPRET unset)")
    return "cuda"


TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """``dtype``: the lowest precision the kernel computed or stored in."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    return assert_close
