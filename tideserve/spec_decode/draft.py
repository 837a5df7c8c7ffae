"""The draft-model method's start-up checks: which target and draft can share one KV pool.

The draft's KV lives in the target's pool as extra layers (target layers first, then the draft's), under the
same block tables, so every move of the pool (resize, compaction, swap, block-size change, disk tier) carries
the draft's KV with the target's. That needs one token's K (or V) to have the same shape in both models (KV
heads and head size; the pool has one KV dtype), and the same vocabulary, since the draft's token ids are
verified as the target's. Each refusal names both values. Plain Python over the two architectures.
"""

from __future__ import annotations

from typing import Any


def check_draft_model(target: Any, draft: Any, target_name: str, draft_name: str, max_model_len: int,
                      tensor_parallel_size: int) -> None:
    """ValueError, naming both models' values, unless ``draft`` (an ArchConfig) can draft for ``target``."""
    where = f"speculative_config.model ({draft_name!r}) as the draft of {target_name!r}"
    if tensor_parallel_size > 1:
        raise ValueError(f"{where}: the draft-model method runs with tensor_parallel_size 1 only (got "
                         f"{tensor_parallel_size}); use the ngram method, or one device.")
    if not target.generates or not draft.generates:
        raise ValueError(f"{where}: both models need a language-model head to propose and verify tokens.")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"{where}: the vocabularies differ (target {target.vocab_size} tokens, draft "
                         f"{draft.vocab_size}); the draft must use the target's tokenizer.")
    mine = (target.num_key_value_heads, target.head_dim)
    theirs = (draft.num_key_value_heads, draft.head_dim)
    if mine != theirs:
        raise ValueError(f"{where}: the KV geometry differs (target {mine[0]} KV heads of size {mine[1]}, draft "
                         f"{theirs[0]} KV heads of size {theirs[1]}); the draft's KV shares the target's pool, "
                         "so both must cache the same shape per token and layer.")
    for name, arch in (("target", target), ("draft", draft)):
        groups = arch.kv_cache_groups()
        if groups.is_hybrid:
            raise ValueError(f"{where}: the {name} mixes sliding-window and global layers ({groups.describe()}); "
                             "the draft-model method needs every layer of both models to keep every token.")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"{where}: the draft reaches {draft.max_position_embeddings} positions, fewer than "
                         f"max_model_len ({max_model_len}); lower max_model_len or use a draft that reaches it.")
