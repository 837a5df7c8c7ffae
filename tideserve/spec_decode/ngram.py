"""Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n tokens.

Outputs that copy their prompt (editing a file, answering from a document, summarizing) repeat long spans of
it; after the first few tokens of such a span, its continuation is already in the context. Plain Python over
the request's token ids (a numpy scan for the candidates), a few microseconds per thousand tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Up to ``k`` proposals from the latest match of the last n tokens, n from ``max_n`` down to ``min_n``
    (the longest match wins: it is the most specific context)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n}).")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest matching suffix, at most ``k``; []
        when no suffix of at least ``min_n`` tokens occurred before."""
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        # Candidate ends: earlier positions holding the last token (the match's last token), newest first.
        ends = np.flatnonzero(ids[:-1] == ids[-1])[::-1]
        if ends.size == 0:
            return []
        # match[i]: the i-th candidate's last j + 1 tokens equal the request's, grown one token at a time.
        match = np.ones(ends.size, dtype=bool)
        longest = min(self.max_n, n_tokens - 1)
        best = -1
        for j in range(1, longest):
            starts = ends - j
            match &= starts >= 0
            match[match] &= ids[starts[match]] == ids[n_tokens - 1 - j]
            if j + 1 >= self.min_n and match.any():
                best = int(ends[np.argmax(match)])  # the newest candidate matching j + 1 tokens
            elif j + 1 > self.min_n:
                break
        if self.min_n == 1 and best < 0:
            best = int(ends[0])
        return ids[best + 1:best + 1 + k].tolist() if best >= 0 else []
