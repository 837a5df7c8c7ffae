"""Verification of proposals: the target model's own token at every position, a proposal kept while it
equals that token.

Every proposal here is one token chosen without randomness (a lookup; a draft model's argmax), so its
distribution is a point mass q = 1 at token d. Rejection sampling for such a draft keeps d with probability
min(1, p(d) / q(d)) = p(d) and otherwise draws from the residual max(p - q, 0), which is p without d,
renormalized. Drawing x ~ p and keeping d exactly when x == d is the same law: P(keep) = p(d), and a
rejected position's token x is p conditioned on x != d. So each row is sampled by the ordinary sampler
(greedy rows take the argmax, which makes greedy output identical to decoding without proposals), and the
accepted length is the run of leading rows whose token equals the proposal.

A seeded request draws one vector of noise per sampled row from its own generator (the sampler's
exponential race). Decoding without proposals would have drawn one per token it kept, so after a round the
generator is rewound and advanced by exactly the rows kept: a seeded request draws the same tokens with or
without speculation, in any batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def accepted_length(row_tokens: Sequence[int], proposals: Sequence[int]) -> int:
    """How many leading proposals equal the model's token at their row (row i verifies proposal i)."""
    n = 0
    for token, proposal in zip(row_tokens, proposals):
        if int(token) != proposal:
            break
        n += 1
    return n


def generator_states(spec: Mapping[str, Sequence[int]],
                     requests: Mapping[str, Any]) -> dict[str, tuple[torch.Generator, torch.Tensor]]:
    """(generator, its state now) of each request verifying proposals that samples from its own seeded
    generator: rewound after the round by ``replay_draws``."""
    states = {}
    for rid in spec:
        state = requests[rid]
        if state.generator is not None and not state.sampling_params.greedy:
            states[rid] = (state.generator, state.generator.get_state())
    return states


def replay_draws(saved: tuple[torch.Generator, torch.Tensor] | None, num_kept: int, vocab_size: int) -> None:
    """Rewind a generator to its state before the round and draw the noise of the ``num_kept`` rows kept, as
    the sampler drew it (one float32 Exponential(1) vector of the vocabulary's size per row)."""
    if saved is None:
        return
    generator, state = saved
    generator.set_state(state)
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_kept):
        noise.exponential_(generator=generator)
