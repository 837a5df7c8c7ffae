"""A minimal stand-in for the model runner: per-request block tables over a small paged KV cache, and the
AttentionMetadata for a step that mixes decodes, fresh prefills and prefill chunks after a cached prefix.

Exposed through the ``paged_cache`` fixture (a factory) so test modules need not import each other.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.layers.attention import AttentionMetadata, PrefillSpan


class PagedCache:
    """Owns the per-layer KV tensors and each request's block table; ``step`` builds one forward's inputs.

    Blocks are handed out in shuffled order so a request's blocks are not contiguous (paging is real).
    """

    def __init__(self, arch: ArchConfig, num_blocks: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0, native: bool = False) -> None:
        self.native = native  # decode metadata for the native kernel (tables + lengths) or the torch path
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(arch.num_hidden_layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def slots(self, rid: str, start: int, end: int) -> list[int]:
        b, table = self.block_size, self.block_tables[rid]
        return [table[p // b] * b + p % b for p in range(start, end)]

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: (request id, new token ids) in batch order, single-token queries first.
        Returns (input_ids, positions, meta) and records the new tokens as cached."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_contexts: list[tuple[list[int], int]] = []  # (block table, context length)
        prefills: list[PrefillSpan] = []
        for rid, tokens in chunks:
            cached = self.num_cached.setdefault(rid, 0)
            table = self.block_tables.setdefault(rid, [])
            end = cached + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            start_index = len(input_ids)
            input_ids += list(tokens)
            positions += list(range(cached, end))
            slot_mapping += self.slots(rid, cached, end)
            if len(tokens) == 1:
                assert not prefills, "single-token queries must come before prefills"
                decode_contexts.append((list(table), end))
            elif cached == 0:
                prefills.append(PrefillSpan(start=start_index, query_len=len(tokens), context_len=end))
            else:
                q_pos = torch.arange(cached, end).unsqueeze(1)
                k_pos = torch.arange(end).unsqueeze(0)
                prefills.append(PrefillSpan(start=start_index, query_len=len(tokens), context_len=end,
                                            slots=torch.tensor(self.slots(rid, 0, end)),
                                            mask=(k_pos <= q_pos)[None, None]))
            self.num_cached[rid] = end

        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping), prefills=prefills,
                                 num_decode_tokens=len(decode_contexts))
        if decode_contexts and self.native:
            width = max(len(t) for t, _ in decode_contexts)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in decode_contexts])
            meta.decode_context_lens = torch.tensor([n for _, n in decode_contexts])
        elif decode_contexts:
            width = max(len(t) for t, _ in decode_contexts)
            meta.decode_block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t, _ in decode_contexts])
            keys = width * self.block_size
            meta.decode_mask = torch.tensor(
                [[True] * n + [False] * (keys - n) for _, n in decode_contexts])[:, None, None, :]
        return torch.tensor(input_ids), torch.tensor(positions), meta


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

    def __init__(self, vocab_size: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs = {rid: torch.randint(0, vocab_size, (n,), generator=g).tolist()
                     for rid, n in self.seq_lens.items()}

    def ours(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32,
             native: bool = False) -> list[torch.Tensor]:
        cache = PagedCache(model.arch, num_blocks=32, block_size=4, dtype=dtype, native=native)
        out = []
        for step in self.steps:
            ids, positions, meta = cache.step([(rid, self.seqs[rid][a:b]) for rid, a, b in step])
            hidden = model(ids, positions, cache.kv_caches, meta)
            assert hidden.shape == (len(ids), model.arch.hidden_size)
            out.append(model.compute_logits(hidden))
        return out

    def reference(self, hf_model: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            full = {rid: hf_model(torch.tensor([s])).logits[0].float() for rid, s in self.seqs.items()}
        return [torch.cat([full[rid][a:b] for rid, a, b in step]) for step in self.steps]

    def assert_matches(self, model: torch.nn.Module, hf_model: torch.nn.Module, native: bool = False) -> None:
        """float32: every logit row of every step within rtol 1e-4 of transformers."""
        for got, want in zip(self.ours(model, native=native), self.reference(hf_model), strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture
def paged_cache() -> Callable[..., PagedCache]:
    """Factory: ``paged_cache(arch, num_blocks=64, block_size=4, dtype=torch.float32)``."""
    return PagedCache


@pytest.fixture
def mixed_batch() -> Callable[[int], MixedBatch]:
    """Factory: ``mixed_batch(vocab_size)`` -> MixedBatch with fixed random token sequences."""
    return MixedBatch
