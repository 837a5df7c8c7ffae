"""Which running requests get proposals for their next step, and how many.

Verifying k proposals costs one forward pass over k + 1 tokens. A single stream's step is bound by reading the
weights, so that costs little more than one token, and every accepted proposal saves a step. A large batch's
step is bound by arithmetic, so each proposal costs about what a token costs: there (``disable_by_batch_size``
running requests or more) nothing is proposed. A request whose proposals keep failing pays for verification
and gains nothing: after a round that accepts none, it goes without proposals for a number of steps that
doubles with each such round (up to ``MAX_BACKOFF``) and resets when a round accepts one (``backoff.py``).

A request that follows a grammar gets the proposals its grammar accepts (each verifying row is masked by
the grammar after the proposals before it: ``worker/model_runner.py``); one whose grammar waits for the end
of its reasoning, and pooling requests, get none.

Where the proposals come from: ``ngram.py``'s lookup (method "ngram"), or the draft model's tokens the worker
returned with the previous step (method "draft_model": worker/draft_proposer.py), kept only while the request
still has the tokens they were drafted after. The same policy cuts both. For the draft, ``lookahead`` says how
many tokens it drafts after a step: none where next step's policy would drop them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tideserve.config import SpeculativeConfig
from tideserve.request import Request
from tideserve.spec_decode.ngram import NgramProposer
from tideserve.structured_output.backend import GrammarMatcher


class Speculator:
    """Sets ``request.spec_token_ids`` for every running request before each schedule."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        # The draft model's tokens per request: (the request's token count they follow, the tokens).
        self.drafted: dict[str, tuple[int, list[int]]] = {}
        self._off = False  # proposals off for this step (disable_by_batch_size)

    def propose(self, running: Iterable[Request], num_running: int) -> None:
        off = self._off = num_running >= self.config.disable_by_batch_size
        for request in running:
            request.spec_token_ids = [] if off else self._proposals(request)
        self.drafted = {}

    def receive(self, draft_token_ids: Mapping[str, list[int]], requests: Mapping[str, Request]) -> None:
        """The draft's tokens of a step, once the scheduler has appended the step's tokens: each is a proposal
        for the request's next step only, and only while it still has this many tokens."""
        self.drafted = {rid: (requests[rid].num_tokens, tokens) for rid, tokens in draft_token_ids.items()
                        if rid in requests}

    def lookahead(self, request: Request, num_spec: int) -> int:
        """How many tokens the draft proposes after this step's new token (the step verifies ``num_spec``
        proposals): at most what the next step's policy could keep (``num_speculative_tokens``, the
        ``max_tokens`` left after this step's one sure token), and never a position past ``max_model_len``
        after the most this step can add (the draft writes KV there); 0 where the next step keeps none."""
        grammar = request.structured_output
        if (self._off or request.max_tokens == 0 or request.sampling_params.pooling is not None
                or request.spec_skip_steps > 0 or (grammar is not None and not isinstance(grammar, GrammarMatcher))):
            return 0
        most_tokens = request.num_tokens + num_spec + 1  # after this step
        return max(0, min(self.config.num_speculative_tokens,
                          request.max_tokens - len(request.output_token_ids) - 2,
                          self.max_model_len - most_tokens))

    def _proposals(self, request: Request) -> list[int]:
        if request.num_tokens - request.num_computed_tokens != 1:
            return []  # still prefilling
        grammar = request.structured_output
        if grammar is not None and not isinstance(grammar, GrammarMatcher):
            return []  # a reasoning gate: its mask changes at the end of thinking
        if request.max_tokens == 0 or request.sampling_params.pooling is not None:
            return []
        room = min(self.config.num_speculative_tokens,
                   request.max_tokens - len(request.output_token_ids) - 1,  # the round's own token is one more
                   self.max_model_len - request.num_tokens)
        if room <= 0:
            return []
        if request.spec_skip_steps > 0:
            request.spec_skip_steps -= 1
            return []
        if self.proposer is not None:
            proposals = self.proposer.propose(request.all_token_ids, room)
        else:
            num_tokens, drafted = self.drafted.get(request.request_id, (-1, []))
            proposals = drafted[:room] if num_tokens == request.num_tokens else []
        if request.eos_token_id in proposals:  # nothing follows an end of sequence
            proposals = proposals[:proposals.index(request.eos_token_id)]
        if grammar is not None and proposals:  # only what the grammar allows, so every row has a mask
            proposals = proposals[:grammar.valid_prefix(proposals)]
        return proposals
