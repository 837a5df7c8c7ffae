"""Logprobs in the two OpenAI formats, built from the engine's per-token ``{token_id: Logprob}`` dicts.

Text completions use the legacy parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``); evaluation harnesses score prompts through them with ``echo``, where the first
prompt token has no logprob (``None``). Chat uses ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tideserve.outputs import Logprob
from tideserve.serve.openai.serving import safe_logprob

TokenStr = Callable[[int], str]
Entry = dict[int, Logprob] | None


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best alternatives, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return ranked[:k]


def _token_text(token_id: int, entry: Entry, token_str: TokenStr) -> str:
    # Always through token_str, not the entry's decoded_token: return_tokens_as_token_ids swaps it.
    return token_str(token_id)


class CompletionLogprobs:
    """Accumulates the legacy completions format over chunks; ``text_offset`` continues across them."""

    def __init__(self, k: int, token_str: TokenStr, offset: int = 0) -> None:
        self.k = k
        self.token_str = token_str
        self.offset = offset

    def build(self, token_ids: Sequence[int], entries: Sequence[Entry]) -> dict:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, entry in zip(token_ids, entries):
            text = _token_text(token_id, entry, self.token_str)
            tokens.append(text)
            text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            own = entry.get(token_id)
            token_logprobs.append(safe_logprob(own.logprob) if own is not None else None)
            top = {_token_text(t, entry, self.token_str): safe_logprob(lp.logprob) for t, lp in _top(entry, self.k)}
            if own is not None:
                top.setdefault(text, safe_logprob(own.logprob))
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], k: int, token_str: TokenStr) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(token_id, entry, token_str)
        own = entry.get(token_id) if entry else None
        content.append({
            "token": text,
            "logprob": safe_logprob(own.logprob) if own is not None else -9999.0,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t_text := _token_text(t, entry, token_str)), "logprob": safe_logprob(lp.logprob),
                 "bytes": list(t_text.encode("utf-8"))}
                for t, lp in (_top(entry, k) if entry else [])
            ],
        })
    return {"content": content}


def prompt_logprobs_json(entries: Sequence[Entry], token_str: TokenStr) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the top alternatives."""
    return [None if entry is None else
            {str(t): {"logprob": safe_logprob(lp.logprob), "rank": lp.rank, "decoded_token": token_str(t)}
             for t, lp in entry.items()}
            for entry in entries]


def padded(entries: Sequence[Entry] | None, n: int) -> list[Entry]:
    """Exactly n entries: what the engine returned, then None for tokens it has no logprobs for."""
    entries = list(entries or [])[:n]
    return entries + [None] * (n - len(entries))
