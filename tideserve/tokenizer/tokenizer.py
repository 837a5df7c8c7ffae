"""The engine's tokenizer: a thin facade over a Hugging Face fast tokenizer.

It loads from a GGUF file (vocabulary, merges, special tokens and chat template all come from the file's
metadata) or from a local Hugging Face directory, and exposes only what the engine uses, with the
engine's conventions: ``decode`` never "cleans up" spaces (so streamed text equals decoded text), and
``encode_chat`` puts exactly one BOS in front of a chat prompt whatever the template writes itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tideserve.tokenizer.chat_template import ChatTemplateError, check_syntax, check_template_kwargs, reads_variable
from tideserve.tokenizer.tool_messages import check_tools, prepare_tool_messages, template_mentions

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    """What the engine needs from a tokenizer; ``hf`` is the underlying transformers tokenizer."""

    def __init__(self, hf: Any, *, stop_token_ids: Iterable[int] = (), name: str = "") -> None:
        self.hf = hf
        self.name = name or getattr(hf, "name_or_path", "")
        eos = hf.eos_token_id
        # EOS first, then other end-of-generation ids (GGUF eot/eom, generation_config.json), no repeats.
        ids = ([eos] if eos is not None else []) + list(stop_token_ids)
        self.stop_token_ids: list[int] = list(dict.fromkeys(ids))
        # all_special_ids misses added tokens marked special (a GGUF's control tokens); decode skips both.
        decoder = getattr(hf, "added_tokens_decoder", {}) or {}
        self._special_ids = sorted(set(hf.all_special_ids) | {i for i, t in decoder.items() if t.special})
        bos = hf.bos_token_id
        with_special = hf.encode("a", add_special_tokens=True)
        # Whether plain-text encoding prepends BOS: a chat prompt must then start with exactly one.
        self._adds_bos = bos is not None and bool(with_special) and with_special[0] == bos
        self._warned_tools = False

    # ------------------------------------------------------------------ vocabulary
    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return list(self._special_ids)

    @property
    def adds_bos(self) -> bool:
        """Whether encoding plain text with special tokens puts BOS first."""
        return self._adds_bos

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        return self.hf.convert_ids_to_tokens(ids if isinstance(ids, int) else list(ids))

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):  # a user's request error, so ValueError like the others
            raise ValueError(f"prompt must be a string, got {type(text).__name__}.")  # noqa: TRY004
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Plain concatenation of the tokens' text: no space clean-up, so it matches streamed output."""
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Token sequences to ban for ``bad_words``: each word as it would start the text, and with a
        leading space (mid-text) when that spelling is another token sequence. (vLLM keeps the spaced
        spelling only when it has as many tokens as the bare one, so " Lyon" escapes a ban on "Lyon"
        whose bare form is two tokens; banning both costs nothing.)"""
        sequences: list[list[int]] = []
        for word in words:
            bare = self.hf.encode(word.lstrip(), add_special_tokens=False)
            if bare:
                sequences.append(bare)
            spaced = self.hf.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced != bare:
                sequences.append(spaced)
        return sequences

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
        chat_template: str | None = None, chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False, documents: list[dict] | None = None, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template (or ``chat_template``) to text.

        ``chat_template_kwargs`` become template variables (vLLM's field); ``continue_final_message``
        leaves the last (assistant) message open so the model continues it; ``documents`` go to
        templates that read them. Every failure is a ``ValueError`` (a ``ChatTemplateError`` naming
        the request field when the template or its variables are to blame).
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"the model {self.name!r} has no chat template (GGUF key 'tokenizer.chat_template' or "
                "'chat_template' in tokenizer_config.json); send a plain prompt or pass a chat_template."
            )
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                    "True.", "continue_final_message")
        variables = check_template_kwargs(chat_template_kwargs)
        check_syntax(template)
        if documents is not None:
            if not reads_variable(template, "documents"):
                raise ChatTemplateError("documents is not supported by this chat template: it does not read "
                                        "`documents`, so the model would never see them.", "documents")
            kwargs["documents"] = documents
        normalized = prepare_tool_messages(normalize_messages(messages), template)
        if continue_final_message and normalized[-1]["role"] != "assistant":
            raise ChatTemplateError("continue_final_message needs the last message to be the assistant's (the "
                                    f"text to continue); it is {normalized[-1]['role']!r}.",
                                    "continue_final_message")
        if kwargs.get("tools") is not None:
            kwargs["tools"] = check_tools(kwargs["tools"])
            if not template_mentions(template, "tools") and not self._warned_tools:
                self._warned_tools = True
                logger.warning("The chat template of %r does not render `tools`: the model does not see the "
                               "tool definitions (tool_choice 'required' or a named tool still constrains its "
                               "output to valid calls).", self.name)
        try:
            return self.hf.apply_chat_template(
                normalized, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template,
                continue_final_message=continue_final_message, **variables, **kwargs
            )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors, incl. the template's own raise_exception(...)
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of a rendered chat prompt, with exactly one BOS when the tokenizer uses one.

        Templates usually write special tokens (BOS included) themselves, so the text is encoded without
        adding any; BOS is prepended only if the tokenizer adds one and the template did not.
        ``add_special_tokens`` True or False (vLLM's field) instead encodes the text with or without the
        tokenizer's special tokens, as is.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if add_special_tokens is not None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        ids = self.hf.encode(text, add_special_tokens=False)
        if self._adds_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """Validate OpenAI-style messages and flatten text-part lists into strings (joined by newlines).

    Raises ``ValueError`` naming the offending message; keys other than role/content (name,
    tool_calls, tool_call_id) pass through for templates that use them.
    """
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):  # a user's request error, so ValueError like the others
            kind = type(message).__name__
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {kind}.")  # noqa: TRY004
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}.")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        elif isinstance(content, list):
            content = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of {{'type': 'text', 'text': ...}} parts; "
                f"got {type(content).__name__}."
            )
        normalized.append({**message, "content": content})
    return normalized


def _text_part(part: Any, i: int, j: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(
            f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}; got {kind!r} "
            "(only text content is supported)."
        )
    return part["text"]


# ---------------------------------------------------------------------- loading
def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load from a ``.gguf`` file, or a local directory with Hugging Face tokenizer files (or one GGUF)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not _is_gguf(path):
            raise ValueError(
                f"tokenizer path {path!r} is a file but not a GGUF file; pass a .gguf or a directory."
            )
        return _load_gguf(path)
    if os.path.isdir(path):
        names = os.listdir(path)
        if not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} & set(names):
            ggufs = sorted(n for n in names if n.endswith(".gguf"))
            if len(ggufs) == 1:
                return _load_gguf(os.path.join(path, ggufs[0]))
            raise ValueError(
                f"tokenizer directory {path!r} has no tokenizer.json / tokenizer_config.json "
                f"and {len(ggufs)} .gguf files (need exactly one)."
            )
        return _load_hf_dir(path)
    raise ValueError(f"tokenizer path {path!r} does not exist (expected a .gguf file or a local directory).")


def _load_gguf(path: str) -> Tokenizer:
    # PreTrainedTokenizerFast rather than AutoTokenizer: the latter also builds a model config, which
    # parses the whole vocabulary a second time (seconds on a small CPU).
    from transformers import PreTrainedTokenizerFast

    from tideserve.model.loader.gguf_index import read_gguf_index

    meta = read_gguf_index(path).metadata
    directory, name = os.path.split(path)
    hf = PreTrainedTokenizerFast.from_pretrained(directory or ".", gguf_file=name)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        hf.chat_template = template
    for attr, key in (("eos_token", "eos_token_id"), ("bos_token", "bos_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and getattr(hf, f"{attr}_id") != token_id and 0 <= token_id < len(hf):
            setattr(hf, attr, hf.convert_ids_to_tokens(token_id))
    extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if isinstance(meta.get(k), int)]
    tok = Tokenizer(hf, stop_token_ids=extra, name=path)
    logger.info("loaded tokenizer from GGUF %s: %d tokens, eos=%s, chat template: %s",
                path, tok.vocab_size, tok.eos_token_id, "yes" if tok.chat_template else "no")
    return tok


def _load_hf_dir(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    if not getattr(hf, "is_fast", False):
        logger.warning("tokenizer in %s is not a fast tokenizer; decoding will be slower", path)
    extra: list[int] = []
    gen_config = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_config):
        with open(gen_config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else [t for t in eos or [] if isinstance(t, int)]
    tok = Tokenizer(hf, stop_token_ids=extra, name=path)
    logger.info("loaded tokenizer from %s: %d tokens, eos=%s, chat template: %s",
                path, tok.vocab_size, tok.eos_token_id, "yes" if tok.chat_template else "no")
    return tok


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
