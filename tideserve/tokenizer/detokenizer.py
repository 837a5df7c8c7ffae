"""Incremental detokenization with stop strings.

Streaming text token by token must give the same text as decoding all tokens at once, although one
character can span several tokens (byte-level BPE splits Chinese and emoji into byte pieces) and some
tokenizers drop a leading space when a token is decoded alone. The prefix/read offset technique handles
both: decode a small window ``ids[prefix_offset:]`` and the window's already-emitted part
``ids[prefix_offset:read_offset]``, emit the difference, and only when it does not end with U+FFFD (an
incomplete character). The window starts with a few prompt tokens so the first output token is decoded
in context. Each step decodes a handful of tokens, never the whole output.

Stop strings are searched only in the newly appended tail. While the request runs, ``text`` holds back
the last ``longest_stop - 1`` characters, which could still become the start of a stop string, so a stop
string never reaches a client.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens to decode in front of the first output token: enough context for leading spaces.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, incrementally, and watches for stop strings.

    ``tokenizer`` is a ``Tokenizer`` (or any object with a transformers-style ``decode``).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self._backend = _rust_tokenizer(self._hf)
        self.skip_special_tokens = skip_special_tokens
        # Skipped tokens add no text, so they stay out of the window: a long run of them (a model looping
        # on a special token with ignore_eos) must not grow each step's decode.
        special = getattr(tokenizer, "all_special_ids", None) or getattr(self._hf, "all_special_ids", ())
        self._skip_ids = frozenset(special) if skip_special_tokens else frozenset()
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: output bytes would merge with it, so decode without context.
            context, context_text = [], ""
        # Window over context + output ids: [prefix_offset:read_offset] is decoded and already emitted.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

        self.output_token_ids: list[int] = []
        self._text = ""  # all output text decoded so far (truncated at a stop string)
        self._delta_pos = 0
        self.stop_string: str | None = None
        self.finished = False

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """Text safe to show now (it only grows). Until finished, a possible stop start is held back."""
        if self.finished or not self._hold:
            return self._text
        return self._text[: max(0, len(self._text) - self._hold)]

    def take_delta(self) -> str:
        """Text made safe to show since the previous call (for streaming)."""
        text = self.text
        delta, self._delta_pos = text[self._delta_pos:], len(text)
        return delta

    def append(self, token_ids: Sequence[int]) -> str | None:
        """Add generated tokens; returns the stop string if one now appears (and then finishes).

        On a stop string, the text ends right before it, or right after it with
        ``include_stop_str_in_output``; ids after the one that completed it are not consumed.
        """
        if self.finished:
            raise RuntimeError("append() after the detokenizer finished (stop string or finish()).")
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            if token_id in self._skip_ids:
                continue
            before = len(self._text)
            self._text += self._step(token_id)
            if self.stop and len(self._text) > before:
                stop = self._check_stop(before)
                if stop is not None:
                    return stop
        return None

    def finish(self) -> None:
        """The request ended: flush incomplete characters (as U+FFFD, like ``decode``) and the hold-back."""
        if self.finished:
            return
        pending = self._decode(self._ids[self._prefix_offset:])
        if len(pending) > len(self._prefix_text):
            before = len(self._text)
            self._text += pending[len(self._prefix_text):]
            if self.stop and self._check_stop(before) is not None:
                return
        self.finished = True

    # ------------------------------------------------------------------ internals
    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self._hf.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _step(self, token_id: int) -> str:
        """New text completed by one token, or "" while a character is still incomplete."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text):]
        # Slide the window: what was read becomes the context of the next decode.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        # Drop ids that left the window so memory stays bounded by the window, not the output.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _check_stop(self, before: int) -> str | None:
        """Find the stop string that completes first in the text added after ``before``; truncate there.

        "First" is the smallest end position (then the earliest start), so the result does not depend on
        how the text was split into tokens or appends.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, max(0, before - len(stop) + 1))
            if index != -1 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        if best is None:
            return None
        end, index, stop = best
        self._text = self._text[: end if self.include_stop_str_in_output else index]
        self.stop_string = stop
        self.finished = True
        return stop


def _rust_tokenizer(hf: Any) -> RustTokenizer | None:
    """The ``tokenizers.Tokenizer`` behind a fast HF tokenizer, or None. Its decode is what the HF decode
    calls when clean_up_tokenization_spaces is off, without the argument handling around it, which costs
    more than the decode itself at one call per request per step (64 streams: ~0.6 ms a step)."""
    backend = getattr(hf, "_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None
