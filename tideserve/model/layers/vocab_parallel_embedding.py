"""The vocabulary split across tensor-parallel ranks: the embedding table and the LM head.

Each rank keeps a contiguous range of ``ceil(vocab / world)`` rows (the last range padded with zero rows,
so every rank's logits have the same width for the all-gather). Looking tokens up, a rank embeds the ids
in its range and writes zeros for the others; one all-reduce sums the ranks' rows into the full
embedding. The LM head multiplies by the rank's rows and all-gathers the slices into full logits, which
every rank then holds (the driver samples; the other ranks need them only to stay in lockstep).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tideserve.model.layers.linear import CollectiveGroup


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first row, end row, rows per rank incl. padding) of ``rank``'s slice of the vocabulary."""
    per_rank = -(-vocab_size // world_size)
    start = min(vocab_size, rank * per_rank)
    return start, min(vocab_size, start + per_rank), per_rank


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's rows of the table; the weight is [rows per rank, hidden]."""

    def __init__(self, table: torch.Tensor, group: CollectiveGroup) -> None:
        super().__init__()
        self.vocab_size = table.shape[0]
        self.group = group
        self.start, self.end, per_rank = vocab_range(self.vocab_size, group.rank, group.world_size)
        weight = table.new_zeros(per_rank, table.shape[1])
        weight[: self.end - self.start] = table[self.start:self.end]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.qweight = None  # the model's Embedding contract: float rows only

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        h = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(h)


class ParallelLMHead(nn.Module):
    """hidden [N, H] -> full float32 logits [N, vocab]: this rank's slice, all-gathered."""

    def __init__(self, embedding: VocabParallelEmbedding) -> None:
        super().__init__()
        self.embedding = embedding  # the same rows (a tied head) or an untied head's own slice

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.embedding.weight)
        return self.embedding.group.all_gather(local)[:, : self.embedding.vocab_size].float()
