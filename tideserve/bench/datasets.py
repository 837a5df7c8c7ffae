"""Benchmark workloads: lists of (prompt text, prompt token ids, output length).

Every engine in a comparison must see the same prompts, so each request carries both its text (what an
HTTP client sends) and the token ids that text encodes to (what an in-process engine is fed). The random
datasets are built so the two agree: the text re-encodes to exactly the stored ids.

Datasets:
- ``random``: like vLLM's random dataset, prompts are random token ids decoded through the model's
  tokenizer (gibberish text, but exact, controllable lengths), input/output lengths drawn uniformly from
  ``len * (1 - range_ratio) .. len * (1 + range_ratio)``; ``prefix_len`` prepends one shared random prefix
  (a system prompt every request shares, for prefix caching).
- ``mixed``: realistic mixed lengths, prompt 20-1000 and output 16-512 tokens, drawn log-uniformly
  (many short requests, a long tail of long ones) from a seeded generator: the workload where static
  batching pays for its stragglers.
- ``prompts-file``: real prompts, one per line of a text file, or JSON Lines with ``{"prompt": ...}`` and
  optionally ``"output_len"``; output lengths otherwise come from ``output_len`` and ``range_ratio``.
- ``editing``: chat requests to rewrite a short file (code, a README) with one small change and print it whole
  (``bench/data/editing.jsonl``): the output copies most of the prompt, the workload of code editors, where
  n-gram speculation pays. Each may write its file plus 48 tokens.
- ``questions``: open-ended chat questions (``bench/data/questions.txt``): little of the output is in the
  prompt, the workload where speculation must cost nothing.
The last two are chat prompts: ``prompt`` is the user's message (``bench serve --endpoint chat`` sends it as
one), ``prompt_token_ids`` the model's chat template applied to it (what ``bench offline`` feeds).
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

DATASETS = ("random", "mixed", "prompts-file", "editing", "questions")
DATA = Path(__file__).with_name("data")
MIXED_INPUT_RANGE = (20, 1000)
MIXED_OUTPUT_RANGE = (16, 512)


class TokenizerLike(Protocol):
    """What a dataset needs from a tokenizer: tideserve's Tokenizer satisfies it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class SampleRequest:
    """One benchmark request; ``prompt_len == len(prompt_token_ids)``."""

    prompt: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _uniform_lengths(rng: random.Random, n: int, mean: int, range_ratio: float, name: str) -> list[int]:
    if mean < 1:
        raise ValueError(f"{name}={mean} must be at least 1.")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1).")
    lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _normal_ids(tokenizer: TokenizerLike) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def _num_added_special(tokenizer: TokenizerLike) -> int:
    """Tokens ``encode`` adds around plain text (a BOS for some models)."""
    return len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))


def text_of_length(tokenizer: TokenizerLike, rng: random.Random, length: int,
                   pool: list[int] | None = None,
                   prefix_ids: list[int] | None = None) -> tuple[str, list[int]]:
    """Random text that ``encode``s to exactly ``length`` tokens, and those ids.

    ``prefix_ids`` (plain ids, no special tokens) lead the text. Decoding random ids and re-encoding
    the text merges or splits some tokens, so the tail is re-drawn until the round trip is stable at the
    target length (vLLM does the same); the work happens on plain ids so a BOS is never decoded as text.
    """
    pool = pool or _normal_ids(tokenizer)
    prefix_ids = list(prefix_ids or [])
    target = length - _num_added_special(tokenizer)
    if target <= len(prefix_ids):
        raise ValueError(f"input length {length} must exceed the shared prefix length {len(prefix_ids)}.")
    ids = prefix_ids + [rng.choice(pool) for _ in range(target - len(prefix_ids))]
    for _ in range(20):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            ids = encoded + [rng.choice(pool) for _ in range(target - len(encoded))]
    else:  # rare: settle for the nearest stable length rather than loop forever
        text = tokenizer.decode(ids, skip_special_tokens=False)
        logger.debug("random prompt did not settle at %d tokens", length)
    return text, tokenizer.encode(text)


def random_requests(tokenizer: TokenizerLike, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0, prefix_len: int = 0) -> list[SampleRequest]:
    """vLLM-style random prompts; ``prefix_len`` tokens of one shared prefix lead every prompt."""
    rng = random.Random(seed)
    pool = _normal_ids(tokenizer)
    prefix_ids: list[int] = []
    if prefix_len > 0:
        prefix_text, _ = text_of_length(tokenizer, rng, prefix_len, pool)
        prefix_ids = tokenizer.encode(prefix_text, add_special_tokens=False)
    in_lens = _uniform_lengths(rng, num_prompts, input_len, range_ratio, "input_len")
    out_lens = _uniform_lengths(rng, num_prompts, output_len, range_ratio, "output_len")
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        text, ids = text_of_length(tokenizer, rng, prefix_len + n_in, pool, prefix_ids)
        requests.append(SampleRequest(text, ids, n_out))
    return requests


def mixed_requests(tokenizer: TokenizerLike, num_prompts: int, seed: int = 0,
                   input_range: tuple[int, int] = MIXED_INPUT_RANGE,
                   output_range: tuple[int, int] = MIXED_OUTPUT_RANGE) -> list[SampleRequest]:
    """Log-uniform prompt and output lengths: mostly short requests with a long tail."""
    rng = random.Random(seed)
    pool = _normal_ids(tokenizer)
    requests = []
    for _ in range(num_prompts):
        n_in = _log_uniform(rng, *input_range)
        n_out = _log_uniform(rng, *output_range)
        text, ids = text_of_length(tokenizer, rng, n_in, pool)
        requests.append(SampleRequest(text, ids, n_out))
    return requests


def file_requests(tokenizer: TokenizerLike, path: str | Path, num_prompts: int, output_len: int,
                  range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Prompts from a text file (one per line) or JSON Lines; cycled when ``num_prompts`` exceeds them."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset_path {str(path)!r} is not a file (expected one prompt per line or JSONL).")
    entries: list[tuple[str, int | None]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg}).") from None
            if not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: a JSON line needs a string 'prompt' field.")
            entries.append((obj["prompt"], obj.get("output_len")))
        else:
            entries.append((line, None))
    if not entries:
        raise ValueError(f"dataset_path {str(path)!r} has no prompts.")
    rng = random.Random(seed)
    default_lens = _uniform_lengths(rng, num_prompts, output_len, range_ratio, "output_len")
    requests = []
    for i in range(num_prompts):
        text, n_out = entries[i % len(entries)]
        requests.append(SampleRequest(text, tokenizer.encode(text), int(n_out or default_lens[i])))
    return requests


def _chat_ids(tokenizer: TokenizerLike, text: str) -> list[int]:
    """The chat template applied to one user message (plain encoding for a tokenizer without one)."""
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is not None:
        try:
            return encode_chat([{"role": "user", "content": text}])
        except ValueError:  # no chat template
            pass
    return tokenizer.encode(text)


def editing_requests(tokenizer: TokenizerLike, num_prompts: int) -> list[SampleRequest]:
    """Rewrite-this-file chat prompts, cycled; each may write its file's tokens plus 48."""
    entries = [json.loads(line) for line in (DATA / "editing.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    requests = []
    for i in range(num_prompts):
        entry = entries[i % len(entries)]
        text = (f"{entry['instruction']} Print the whole file after the change, and nothing else.\n\n"
                f"```\n{entry['source']}```")
        out_len = len(tokenizer.encode(entry["source"], add_special_tokens=False)) + 48
        requests.append(SampleRequest(text, _chat_ids(tokenizer, text), out_len))
    return requests


def question_requests(tokenizer: TokenizerLike, num_prompts: int, output_len: int) -> list[SampleRequest]:
    """Open-ended chat questions, cycled, each with ``output_len`` tokens at most."""
    questions = [q for q in (DATA / "questions.txt").read_text(encoding="utf-8").splitlines() if q.strip()]
    return [SampleRequest(q, _chat_ids(tokenizer, q), output_len)
            for q in (questions[i % len(questions)] for i in range(num_prompts))]


def build_requests(tokenizer: TokenizerLike, dataset: str, num_prompts: int, *, input_len: int = 1024,
                   output_len: int = 128, range_ratio: float = 0.0, seed: int = 0, prefix_len: int = 0,
                   dataset_path: str | None = None) -> list[SampleRequest]:
    """The one entry point the CLI and the comparison script use."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be at least 1.")
    if dataset == "random":
        return random_requests(tokenizer, num_prompts, input_len, output_len, range_ratio, seed, prefix_len)
    if dataset == "mixed":
        return mixed_requests(tokenizer, num_prompts, seed)
    if dataset == "prompts-file":
        if not dataset_path:
            raise ValueError("dataset 'prompts-file' needs --dataset-path.")
        return file_requests(tokenizer, dataset_path, num_prompts, output_len, range_ratio, seed)
    if dataset == "editing":
        return editing_requests(tokenizer, num_prompts)
    if dataset == "questions":
        return question_requests(tokenizer, num_prompts, output_len)
    raise ValueError(f"dataset {dataset!r} is not one of {', '.join(DATASETS)}.")


def ignore_eos_default(dataset: str) -> bool:
    """Synthetic prompts ask for exact output lengths (as vLLM's random dataset does); real ones do not."""
    return dataset in ("random", "mixed")
