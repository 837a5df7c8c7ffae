"""logit_bias, allowed_token_ids and bad_words: one sparse step over the whole batch's logits.

All three only ever touch a few (row, token) cells of a [rows, vocab] logits tensor, so they are gathered
into flat index tensors and applied with one ``index_put_(accumulate=True)``: a bias adds its value
(OpenAI's logit_bias semantics), a ban adds -inf (bad words, tokens outside allowed_token_ids). The
per-request parts that never change (the bias ids and values, the allowed ids, single-token bad words)
are turned into tensors once per request and cached on its ``SamplingParams``, so a step concatenates
one small tensor per row: no Python loop over tokens. Only multi-token bad words are checked per step,
against the row's latest output tokens, as vLLM does.

The step runs after min_tokens and before the penalties, on the logits the logprobs are *not* taken from
(logprobs stay those of the model's raw distribution, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tideserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class LogitBias:
    """The step's sparse logits edits: cell (rows[i], token_ids[i]) gets values[i] added; rows in
    ``allowed_rows`` keep only their cells (allowed_index[j], allowed_ids[j]), the rest go to -inf."""

    rows: torch.Tensor | None  # [E] long
    token_ids: torch.Tensor | None  # [E] long
    values: torch.Tensor | None  # [E] float32 (-inf for a ban)
    allowed_rows: torch.Tensor | None  # [R] long: rows restricted to allowed_token_ids
    allowed_index: torch.Tensor | None  # [A] long, into allowed_rows
    allowed_ids: torch.Tensor | None  # [A] long

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
              device: torch.device) -> LogitBias | None:
        """None when no row uses any of the three (the common case costs one pass over ``params``)."""
        if not any(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids for p in params):
            return None
        ids, values, counts = [], [], []
        allowed_rows, allowed_ids, allowed_counts = [], [], []
        for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
            num = 0
            if p.logit_bias:
                bias_ids, bias_values = _cached(p, "logit_bias", lambda p=p: (
                    torch.tensor(list(p.logit_bias), dtype=torch.long),
                    torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)))
                ids.append(bias_ids)
                values.append(bias_values)
                num += len(bias_ids)
            if p.bad_words_token_ids:
                banned = banned_tokens(p, output)
                if banned is not None:
                    ids.append(banned)
                    values.append(torch.full((len(banned),), _NEG_INF))
                    num += len(banned)
            counts.append(num)
            if p.allowed_token_ids:
                allowed = _cached(p, "allowed_token_ids",
                                  lambda p=p: torch.tensor(sorted(set(p.allowed_token_ids)), dtype=torch.long))
                allowed_rows.append(row)
                allowed_ids.append(allowed)
                allowed_counts.append(len(allowed))
        out = cls(None, None, None, None, None, None)
        if ids:
            out.rows = torch.repeat_interleave(torch.arange(len(params)), torch.tensor(counts)).to(device)
            out.token_ids = torch.cat(ids).to(device)
            out.values = torch.cat(values).to(device)
        if allowed_rows:
            out.allowed_rows = torch.tensor(allowed_rows, dtype=torch.long, device=device)
            out.allowed_index = torch.repeat_interleave(torch.arange(len(allowed_rows)),
                                                        torch.tensor(allowed_counts)).to(device)
            out.allowed_ids = torch.cat(allowed_ids).to(device)
        return out


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """Add the biases and bans to ``logits`` [rows, vocab] (float32, the sampler's private copy), in
    place; token ids were checked against the vocabulary when the request was accepted."""
    if bias.allowed_rows is not None:
        keep = torch.zeros(len(bias.allowed_rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[bias.allowed_index, bias.allowed_ids] = True
        logits[bias.allowed_rows] = logits[bias.allowed_rows].masked_fill(~keep, _NEG_INF)
    if bias.rows is not None:
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    return logits


def banned_tokens(params: SamplingParams, output: Sequence[int]) -> torch.Tensor | None:
    """Token ids a row must not sample next: the last token of each bad word whose other tokens are
    the row's latest output tokens (a single-token bad word is always banned)."""
    single = _cached(params, "bad_words_single", lambda: torch.tensor(
        sorted({w[0] for w in params.bad_words_token_ids if len(w) == 1}), dtype=torch.long))
    banned = [w[-1] for w in params.bad_words_token_ids
              if 1 < len(w) <= len(output) + 1 and list(output[len(output) - len(w) + 1:]) == w[:-1]]
    if banned:
        return torch.cat([single, torch.tensor(banned, dtype=torch.long)])
    return single if len(single) else None


def _cached(params: SamplingParams, key: str, make):
    """Per-request tensors, built on first use and kept on the request's SamplingParams (CPU)."""
    value = params.derived.get(key)
    if value is None:
        value = params.derived[key] = make()
    return value
