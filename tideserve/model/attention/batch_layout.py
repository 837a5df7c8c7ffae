"""What every attention backend's metadata builder reads: one step's flat batch, laid out on the host.

The runner (and tests) describe a step once, as numpy arrays over requests in batch order, single-token
queries (decodes) first; each backend's ``build_metadata`` turns that into the tensors its kernels read.
So there is one way to describe a batch and one builder per backend, not one encoding per call site.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class BatchLayout:
    """One step's requests, in batch order (decodes first, then prefill chunks).

    ``block_tables`` [R, W] int64 holds request i's block ids in row i (zero-padded past its own blocks);
    ``num_computed`` [R] the tokens already in the cache before this step; ``query_lens`` [R] the tokens
    this step computes. Derived: ``query_start_loc`` [R + 1], ``context_lens`` [R] (keys after this step),
    ``positions`` [T] and ``slot_mapping`` [T] (``block_table[pos // B] * B + pos % B``), vectorized.
    """

    block_tables: np.ndarray
    num_computed: np.ndarray
    query_lens: np.ndarray
    num_decodes: int
    block_size: int
    query_start_loc: np.ndarray = field(init=False)
    context_lens: np.ndarray = field(init=False)
    positions: np.ndarray = field(init=False)
    slot_mapping: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        bs = self.block_size
        counts = self.query_lens
        self.query_start_loc = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.query_start_loc[1:])
        total = int(self.query_start_loc[-1])
        self.context_lens = self.num_computed + counts
        # positions: for each request, num_computed .. num_computed + query_len - 1
        self.positions = (np.repeat(self.num_computed - self.query_start_loc[:-1], counts)
                          + np.arange(total, dtype=np.int64))
        rows = np.repeat(np.arange(len(counts)), counts)
        self.slot_mapping = self.block_tables[rows, self.positions // bs] * bs + self.positions % bs

    @classmethod
    def from_lists(cls, block_tables: list[list[int]], num_computed: list[int], query_lens: list[int],
                   block_size: int) -> BatchLayout:
        """From plain lists (tests, tools); decodes are the leading rows with one query token."""
        width = max(1, max(len(t) for t in block_tables))
        tables = np.zeros((len(block_tables), width), dtype=np.int64)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if any(n == 1 for n in query_lens[num_decodes:]):
            raise ValueError("single-token queries (decodes) must come before every prefill in the batch")
        return cls(tables, np.asarray(num_computed, dtype=np.int64), np.asarray(query_lens, dtype=np.int64),
                   num_decodes, block_size)

    @classmethod
    def single_prefill(cls, num_tokens: int, block_size: int) -> BatchLayout:
        """One fresh prompt of ``num_tokens`` in blocks 0, 1, 2, ... (profiling and calibration passes)."""
        tables = np.arange(-(-num_tokens // block_size), dtype=np.int64)[None, :]
        return cls(tables, np.zeros(1, dtype=np.int64), np.array([num_tokens], dtype=np.int64),
                   int(num_tokens == 1), block_size)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_decode_tokens(self) -> int:
        """Decodes have one query token each, so they are also the first tokens of the flat batch."""
        return self.num_decodes


@dataclass
class PrefillSpan:
    """One request's multi-token query inside the flat batch (the torch SDPA prefill path).

    ``context_len`` counts every key the query attends to (cached prefix + this chunk). When it equals
    ``query_len`` nothing is cached yet, and the chunk's own keys are used directly with a causal mask.
    """

    start: int
    query_len: int
    context_len: int
    slots: torch.Tensor | None = None  # [context_len] cache slots of the whole context (None when no prefix)
    mask: torch.Tensor | None = None  # [1, 1, query_len, context_len] bool, True = may attend

