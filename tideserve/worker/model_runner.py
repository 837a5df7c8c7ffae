"""Turns the scheduler's plain message into tensors, runs the model and samples.

The runner is the only owner of the KV tensors and keeps its own per-request state (token ids, block
table), updated from the scheduler's diffs. Batch tensors are built once per step with numpy: positions,
slot mapping (``block_table[pos // B] * B + pos % B``), the decode gather slots and the prefill spans.
Single-token queries (decodes) go first in the flat batch so attention can batch them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tideserve.core.scheduler import SchedulerOutput
from tideserve.model.layers.attention import AttentionMetadata, PrefillSpan
from tideserve.model.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from tideserve.outputs import Logprob
from tideserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None = None


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]
    # Per request asking for prompt logprobs: (index of the first prompt token scored, one entry per
    # prompt token scored in this step: the logprob of token i given tokens 0..i-1).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches = self.allocate_kv_caches(num_blocks)

    # ----------------------------------------------------------------- KV tensors
    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        arch = self.model.arch
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        bs = block_size or self.block_size
        return 2 * arch.num_hidden_layers * bs * arch.num_key_value_heads * arch.head_dim * elem

    def allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K and V as [num_blocks, block_size, num_kv_heads, head_dim].

        ``torch.empty``: pages are committed only when a block is first written, and attention never reads
        a slot that was not written (padding points at each request's own first slot).
        """
        arch = self.model.arch
        shape = (num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        return [(torch.empty(shape, dtype=self.kv_dtype, device=self.device),
                 torch.empty(shape, dtype=self.kv_dtype, device=self.device))
                for _ in range(arch.num_hidden_layers)]

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    # ----------------------------------------------------------------- state from the scheduler
    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids:
            self.requests.pop(request_id, None)
        for request_id in out.preempted_ids:
            self.requests.pop(request_id, None)
        for new in out.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.generator,
                new.eos_token_id, list(new.block_ids), new.num_computed_tokens)
        for cached in out.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ----------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        result = ModelRunnerOutput({}, {})
        if out.is_empty:
            return result
        decode_ids = [rid for rid, n in out.num_scheduled_tokens.items() if n == 1]
        prefill_ids = [rid for rid, n in out.num_scheduled_tokens.items() if n > 1]
        order = decode_ids + prefill_ids
        batch = self._build_batch(order, out.num_scheduled_tokens, len(decode_ids))
        input_ids, positions, meta, sample_rows, sample_ids = batch

        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self._prompt_logprobs(order, out.num_scheduled_tokens, hidden, result)
        for rid in order:
            self.requests[rid].num_computed_tokens += out.num_scheduled_tokens[rid]
        if not sample_ids:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])
        states = [self.requests[rid] for rid in sample_ids]
        sampling_meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in states],
            output_token_ids=[s.token_ids[s.num_prompt_tokens:] for s in states],
            eos_token_ids=[s.eos_token_id for s in states],
            device=self.device,
        )
        sampled = self.sampler(logits, sampling_meta)
        token_ids = sampled.sampled_token_ids
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        for row, (rid, state) in enumerate(zip(sample_ids, states)):
            token = int(token_ids[row])
            state.token_ids.append(token)
            lp = sampled.logprobs[row] if sampled.logprobs is not None else None
            result.sampled[rid] = SampledToken(token, lp)
        return result

    def _prompt_logprobs(self, order: list[str], num_scheduled: dict[str, int], hidden: torch.Tensor,
                         result: ModelRunnerOutput) -> None:
        """Score the prompt tokens of requests that asked for it (completions with echo + logprobs)."""
        start = 0
        for rid in order:
            n = num_scheduled[rid]
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            first = state.num_computed_tokens
            # Rows whose next token is still a prompt token: positions first .. num_prompt - 2.
            last = min(first + n, state.num_prompt_tokens - 1)
            if k is not None and last > first:
                rows = hidden[start:start + (last - first)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                targets = torch.tensor(state.token_ids[first + 1:last + 1], device=logprobs.device)
                entries = gather_logprobs(logprobs, targets, [k] * (last - first), k)
                result.prompt_logprobs[rid] = (first + 1, [e for e in entries if e is not None])
            start += n

    def _build_batch(self, order: list[str], num_scheduled: dict[str, int], num_decodes: int):
        bs = self.block_size
        counts = np.array([num_scheduled[rid] for rid in order], dtype=np.int64)
        starts = np.array([self.requests[rid].num_computed_tokens for rid in order], dtype=np.int64)
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        # positions: for each request, start .. start + count - 1
        positions = np.repeat(starts - cu[:-1], counts) + np.arange(total, dtype=np.int64)
        max_blocks = max(len(self.requests[rid].block_ids) for rid in order)
        tables = np.zeros((len(order), max_blocks), dtype=np.int64)
        input_ids = np.empty(total, dtype=np.int64)
        for i, rid in enumerate(order):
            state = self.requests[rid]
            tables[i, :len(state.block_ids)] = state.block_ids
            input_ids[cu[i]:cu[i + 1]] = state.token_ids[starts[i]:starts[i] + counts[i]]
        req_index = np.repeat(np.arange(len(order)), counts)
        slot_mapping = tables[req_index, positions // bs] * bs + positions % bs

        to_dev = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        meta = AttentionMetadata(slot_mapping=to_dev(slot_mapping), num_decode_tokens=num_decodes)
        ends = starts + counts  # context length after this step
        if num_decodes:
            ctx = ends[:num_decodes]
            max_ctx = int(ctx.max())
            nb = -(-max_ctx // bs)
            slots = (tables[:num_decodes, :nb, None] * bs + np.arange(bs)).reshape(num_decodes, -1)[:, :max_ctx]
            valid = np.arange(max_ctx)[None, :] < ctx[:, None]
            slots = np.where(valid, slots, slots[:, :1])  # padding reads the request's own first slot
            meta.decode_slots = to_dev(slots)
            meta.decode_mask = to_dev(valid[:, None, None, :])
        for i in range(num_decodes, len(order)):
            q_len, start, ctx_len = int(counts[i]), int(starts[i]), int(ends[i])
            span = PrefillSpan(start=int(cu[i]), query_len=q_len, context_len=ctx_len)
            if start > 0:
                nb = -(-ctx_len // bs)
                slots = (tables[i, :nb, None] * bs + np.arange(bs)).reshape(-1)[:ctx_len]
                key_pos = np.arange(ctx_len)[None, :]
                query_pos = start + np.arange(q_len)[:, None]
                span.slots = to_dev(slots)
                span.mask = to_dev((key_pos <= query_pos)[None, None])
            meta.prefills.append(span)

        sample_rows, sample_ids = [], []
        for i, rid in enumerate(order):
            if ends[i] >= len(self.requests[rid].token_ids):
                sample_rows.append(int(cu[i + 1]) - 1)
                sample_ids.append(rid)
        return (to_dev(input_ids), to_dev(positions), meta,
                torch.tensor(sample_rows, dtype=torch.long, device=self.device), sample_ids)
