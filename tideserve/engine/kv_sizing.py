"""How large the KV cache is at start-up: the memory account, and the pool's first geometry and policy.

The elastic pool (the default) sizes itself from measurement: the memory the workers report, less the
activation peak of a profiling pass and a safety margin, is its budget; it starts at a small reserve and
grows on demand. A fixed size (``--num-blocks``, ``--kv-cache-memory``, ``--gpu-memory-utilization``)
is checked against the memory that exists now, so a pool that cannot fit fails at start-up with the
numbers instead of at the first burst.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tideserve.config import CacheConfig, SchedulerConfig
from tideserve.core.kv_cache.elastic import ElasticConfig, ElasticPolicy, MemoryAccount, safety_margin
from tideserve.core.kv_cache.geometry import KVGeometry

logger = logging.getLogger(__name__)

GiB = 2**30
# The "average request" a static pool must hold max_num_seqs of: a quarter of max_model_len, capped.
AVERAGE_REQUEST_TOKENS = 512


@dataclass
class KVPlan:
    """The pool's first geometry, the account it was sized from, its elastic policy (None: static) and
    the largest it may ever grow to (the workers reserve that much address space, never memory)."""

    geometry: KVGeometry
    account: MemoryAccount
    policy: ElasticPolicy | None
    reserve_bytes: int


def plan_kv_cache(shape: KVGeometry, cache: CacheConfig, sched: SchedulerConfig, elastic: ElasticConfig,
                  max_model_len: int, account: MemoryAccount, total_bytes: int, num_groups: int = 1) -> KVPlan:
    """Size the pool from measurement (elastic) or from the user's fixed size (static, checked against the
    memory that exists). ``shape``: the geometry's layout and block size (its block count is ignored);
    ``total_bytes``: the device's or the memory limit's size; ``num_groups``: the KV cache groups, each
    holding its own blocks (a prompt prefilled in one step holds a block per position in every group)."""
    per_block = shape.bytes_per_block
    bs = shape.block_size
    blocks_one_request = num_groups * shape.blocks_for_tokens(max_model_len)
    if cache.num_blocks is not None:
        budget = cache.num_blocks * per_block
        check_static_size("num_blocks", f"{cache.num_blocks} blocks", budget, account)
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
        check_static_size("kv_cache_memory", f"{budget / GiB:.2f} GiB", budget, account)
    elif cache.gpu_memory_utilization is not None:
        budget = int(total_bytes * cache.gpu_memory_utilization - account.resident_bytes
                     - account.activation_bytes)
        check_static_size("gpu_memory_utilization",
                          f"{cache.gpu_memory_utilization} of {total_bytes / GiB:.2f} GiB "
                          f"({max(0, budget) / GiB:.2f} GiB for the KV cache)", budget, account)
    else:
        budget = account.budget_bytes
    max_blocks = shape.blocks_for_bytes(budget)
    if max_blocks < blocks_one_request:
        raise ValueError(
            f"KV cache too small for one request of max_model_len={max_model_len} tokens: it needs "
            f"{blocks_one_request * per_block} bytes ({blocks_one_request} blocks of {bs} tokens), but "
            f"only {max(0, budget)} bytes are available for the KV cache; the largest max_model_len "
            f"that fits is {max_blocks * bs}. Lower max_model_len or give the KV cache more memory.")
    swap_bytes = int(cache.swap_space * GiB) if sched.preemption_mode == "swap" else 0
    if not cache.is_static:
        floor_bytes = min(elastic.idle_reserve_bytes, max_blocks * per_block)
        policy = ElasticPolicy(elastic, floor_bytes, max_blocks * per_block)
        geometry = KVGeometry(shape.num_layers, shape.token_bytes, shape.kv_dtype, bs, 0, swap_bytes)
        geometry = geometry.resized(policy.min_blocks(geometry))
        # The largest the pool could ever reach: the whole machine (address space only).
        reserve = max(geometry.pool_bytes, account.budget_bytes, total_bytes)
        return KVPlan(geometry, account, policy, reserve)
    if cache.num_blocks is None:
        fit_max_num_seqs(sched, max_blocks // num_groups, bs, max_model_len)
    geometry = KVGeometry(shape.num_layers, shape.token_bytes, shape.kv_dtype, bs, max_blocks, swap_bytes)
    return KVPlan(geometry, account, None, geometry.pool_bytes)


def memory_account(available: int, weights: int, activation: int, elastic: ElasticConfig, baseline: int,
                   resident: int) -> MemoryAccount:
    """The account the budget is read from, logged once."""
    account = MemoryAccount(available, weights, activation, safety_margin(weights, activation,
                                                                          elastic.margin_floor_bytes),
                            baseline_bytes=baseline, resident_bytes=resident)
    logger.info("%s", account.describe())
    return account


def check_static_size(name: str, value: str, pool_bytes: int, account: MemoryAccount) -> None:
    """A fixed pool must fit the memory that exists now, beside the activation peak and the margin."""
    if pool_bytes > account.budget_bytes:
        raise ValueError(
            f"{name}={value} asks for a {pool_bytes / GiB:.2f} GiB KV cache, but only "
            f"{account.budget_bytes / GiB:.2f} GiB can be given to it: {account.available_bytes / GiB:.2f} "
            f"GiB available after the weights, minus the activation peak "
            f"{account.activation_bytes / GiB:.2f} GiB and the safety margin "
            f"{account.margin_bytes / GiB:.2f} GiB. Use a smaller {name}, or leave it unset for the "
            "elastic pool, which sizes itself.")


def fit_max_num_seqs(sched: SchedulerConfig, num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Static pool: lower max_num_seqs when that many requests of average length cannot fit."""
    average = max(1, min(max_model_len // 4, AVERAGE_REQUEST_TOKENS))
    fit = num_blocks // -(-average // block_size)
    if fit < sched.max_num_seqs:
        logger.warning("Max num seqs reduced due to KV cache constraints: %d -> %d (%d blocks of %d "
                       "tokens hold %d requests of %d tokens)", sched.max_num_seqs, max(1, fit),
                       num_blocks, block_size, fit, average)
        sched.max_num_seqs = max(1, fit)
