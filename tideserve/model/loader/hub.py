"""Hugging Face Hub ids ("org/name") -> a local snapshot directory, or a ValueError that says what to do.

Inference machines are often offline; a cached snapshot is used without the network, and a failed fetch
explains how to point at a local GGUF file or HF directory instead.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# enough to serve a safetensors model and its tokenizer; never the *.bin / *.pt duplicates
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def looks_like_hub_id(model: str) -> bool:
    """True for "org/name" shapes; paths like "./x", "/x", "~/x" or "a/b/c" are not hub ids."""
    return bool(_HUB_ID.match(model))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cannot_fetch(repo_id: str, reason: str) -> ValueError:
    return ValueError(
        f"model {repo_id!r} could not be fetched from the Hugging Face Hub ({reason}). Pass a local path "
        f"instead: a .gguf file, or a directory with config.json and *.safetensors "
        f"(e.g. --model /models/SmolLM2-135M-Instruct.Q4_1.gguf)."
    )


def fetch(repo_id: str) -> str:
    """Return the local snapshot directory of ``repo_id``: the cached one if present, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - it is a dependency of transformers
        raise _cannot_fetch(repo_id, "huggingface_hub is not installed") from e

    try:
        return snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure here only means "not cached"
        logger.debug("no cached snapshot of %s", repo_id)
    if hub_offline():
        raise _cannot_fetch(repo_id, "HF_HUB_OFFLINE is set and it is not in the local cache")
    logger.info("downloading %s from the Hugging Face Hub", repo_id)
    try:
        return snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS)
    except Exception as e:  # network, auth, missing repo: the user sees one message
        raise _cannot_fetch(repo_id, f"{type(e).__name__}: {e}") from e
