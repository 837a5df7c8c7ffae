"""Counters of verified proposals, under vLLM's metric names (serve/metrics.py exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Since start: ``num_drafts`` verification rounds (a request's step that carried proposals),
    ``num_draft_tokens`` proposals verified, ``num_accepted_tokens`` accepted, and per position in the
    proposal (0 = the first) how many rounds accepted it (``accepted_per_pos[i] <= num_drafts``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def for_proposals(cls, num_speculative_tokens: int) -> SpecDecodeStats:
        """Counters with every position's series from the start (0 until a round accepts there)."""
        return cls(accepted_per_pos=[0] * num_speculative_tokens)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed, (num_accepted, num_proposed)
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0.0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification round produced on average: its accepted proposals plus the model's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
