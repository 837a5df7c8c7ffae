"""A minimal stand-in for the model runner: per-request block tables over a small paged KV cache, and, built
by an attention backend's own builder (as the runner does), the metadata for a step that mixes decodes,
fresh prefills and prefill chunks after a cached prefix (the request's own, or another's: a prefix-cache
hit); greedy decoding through it.

Exposed through fixtures (factories) so test modules need not import each other.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.attention import AttentionBackend, AttentionMetadata, BatchLayout, select_attention_backend


class PagedCache:
    """Owns the per-layer KV tensors and each request's block table; ``step`` builds one forward's inputs.

    Blocks are handed out in shuffled order so a request's blocks are not contiguous (paging is real).
    ``backend``: an attention backend, or the name of one for ``model_dtype`` (default: torch).
    """

    def __init__(self, arch: ArchConfig, num_blocks: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0, backend: AttentionBackend | str = "torch",
                 model_dtype: torch.dtype = torch.float32) -> None:
        if isinstance(backend, str):
            backend = select_attention_backend(backend, "cpu", model_dtype, dtype, arch.num_attention_heads,
                                               arch.num_key_value_heads, arch.head_dim)
        self.backend = backend
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(arch.num_hidden_layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def share_prefix(self, src: str, dst: str, num_blocks: int) -> None:
        """A prefix-cache hit: ``dst`` starts with ``src``'s first ``num_blocks`` full blocks (the same block
        ids, not copies) as already-computed tokens."""
        self.block_tables[dst] = self.block_tables[src][:num_blocks]
        self.num_cached[dst] = num_blocks * self.block_size

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: (request id, new token ids) in batch order, single-token queries first.
        Returns (input_ids, positions, meta) and records the new tokens as cached."""
        input_ids: list[int] = []
        tables, computed, counts = [], [], []
        for rid, tokens in chunks:
            cached = self.num_cached.setdefault(rid, 0)
            table = self.block_tables.setdefault(rid, [])
            end = cached + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            input_ids += list(tokens)
            tables.append(list(table))
            computed.append(cached)
            counts.append(len(tokens))
            self.num_cached[rid] = end
        layout = BatchLayout.from_lists(tables, computed, counts, self.block_size)
        meta = self.backend.build_metadata(layout)
        return torch.tensor(input_ids), torch.from_numpy(layout.positions), meta


class MixedBatch:
    """Three steps over three requests A, B, C, with block size 4:
    1. two fresh prefills (A: 7 tokens; C: its first 6-token chunk),
    2. A decodes, B prefills 5 tokens, C prefills 4 more after its cached 6-token prefix,
    3. all three decode at different context lengths.
    ``ours`` runs our model over the paged cache; ``reference`` slices transformers' full-sequence logits.
    """

    seq_lens: ClassVar[dict[str, int]] = {"A": 9, "B": 6, "C": 11}
    steps: ClassVar[list[list[tuple[str, int, int]]]] = [
        [("A", 0, 7), ("C", 0, 6)],
        [("A", 7, 8), ("B", 0, 5), ("C", 6, 10)],
        [("A", 8, 9), ("B", 5, 6), ("C", 10, 11)],
    ]

    # step index -> (src, dst, blocks): ``dst`` starts with ``src``'s first blocks before that step
    shares: ClassVar[dict[int, tuple[str, str, int]]] = {}

    def __init__(self, vocab_size: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs = {rid: torch.randint(0, vocab_size, (n,), generator=g).tolist()
                     for rid, n in self.seq_lens.items()}

    def ours(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32,
             backend: str = "torch") -> list[torch.Tensor]:
        """``dtype``: the KV cache's; ``backend``: the attention backend's name."""
        cache = PagedCache(model.arch, num_blocks=32, block_size=4, dtype=dtype, backend=backend,
                           model_dtype=model.dtype)
        out = []
        for i, step in enumerate(self.steps):
            if i in self.shares:
                cache.share_prefix(*self.shares[i])
            ids, positions, meta = cache.step([(rid, self.seqs[rid][a:b]) for rid, a, b in step])
            hidden = model(ids, positions, cache.kv_caches, meta)
            assert hidden.shape == (len(ids), model.arch.hidden_size)
            out.append(model.compute_logits(hidden))
        return out

    def reference(self, hf_model: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            full = {rid: hf_model(torch.tensor([s])).logits[0].float() for rid, s in self.seqs.items()}
        return [torch.cat([full[rid][a:b] for rid, a, b in step]) for step in self.steps]

    def assert_matches(self, model: torch.nn.Module, hf_model: torch.nn.Module, backend: str = "torch") -> None:
        """float32: every logit row of every step within rtol 1e-4 of transformers."""
        for got, want in zip(self.ours(model, backend=backend), self.reference(hf_model), strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class PrefixHit(MixedBatch):
    """A prefix-cache hit across requests, with block size 4: A prefills 12 tokens (3 blocks); then D, whose
    first 8 tokens are A's, starts on A's first 2 blocks (the same block ids) and prefills its other 5
    tokens beside A's decode; then D decodes."""

    seq_lens: ClassVar[dict[str, int]] = {"A": 13, "D": 14}
    steps: ClassVar[list[list[tuple[str, int, int]]]] = [
        [("A", 0, 12)],
        [("A", 12, 13), ("D", 8, 13)],
        [("D", 13, 14)],
    ]
    shares: ClassVar[dict[int, tuple[str, str, int]]] = {1: ("A", "D", 2)}

    def __init__(self, vocab_size: int, seed: int = 2) -> None:
        super().__init__(vocab_size, seed)
        self.seqs["D"][:8] = self.seqs["A"][:8]


def greedy(model: torch.nn.Module, prompt: Sequence[int], steps: int, backend: str = "torch") -> list[int]:
    """Greedy tokens through a paged cache: one prefill, then single-token decode steps."""
    cache = PagedCache(model.arch, num_blocks=32, block_size=4, backend=backend, model_dtype=model.dtype)
    tokens: list[int] = []
    chunk = list(prompt)
    for _ in range(steps):
        ids, positions, meta = cache.step([("r", chunk)])
        tokens.append(int(model.compute_logits(model(ids, positions, cache.kv_caches, meta))[-1].argmax()))
        chunk = tokens[-1:]
    return tokens


def hf_greedy(hf_model: torch.nn.Module, prompt: Sequence[int], steps: int) -> list[int]:
    """transformers' greedy tokens, each from a full-sequence forward (no cache; no stop at an EOS id)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture
def paged_cache() -> Callable[..., PagedCache]:
    """Factory: ``paged_cache(arch, num_blocks=64, block_size=4, dtype=torch.float32, backend="torch")``."""
    return PagedCache


@pytest.fixture
def mixed_batch() -> Callable[[int], MixedBatch]:
    """Factory: ``mixed_batch(vocab_size)`` -> MixedBatch with fixed random token sequences."""
    return MixedBatch


@pytest.fixture
def prefix_hit() -> Callable[[int], PrefixHit]:
    """Factory: ``prefix_hit(vocab_size)`` -> PrefixHit, used as a MixedBatch (``ours``, ``reference``,
    ``assert_matches``)."""
    return PrefixHit


@pytest.fixture
def greedy_tokens() -> tuple[Callable[..., list[int]], Callable[..., list[int]]]:
    """(``ours(model, prompt, steps, backend="torch")``, ``reference(hf_model, prompt, steps)``): greedy
    tokens through our paged cache and through transformers."""
    return greedy, hf_greedy
