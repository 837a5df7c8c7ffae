"""Turns the scheduler's plain message into tensors, runs the model and samples.

The runner keeps its own per-request state (token ids, block table), updated from the scheduler's diffs,
and reads the KV tensors from its ``KVCacheStorage`` (worker/kv_store.py), which owns them and every move
of their bytes (resize, compaction, swap, block-size change). Each step is laid out once with numpy
(``BatchLayout``: block tables, token counts, positions, slot mapping) and the attention backend chosen at
load builds its metadata from that. Single-token queries (decodes) go first in the flat batch so attention
can batch them.

A model with several KV cache groups (local and global layers: core/kv_cache/groups.py) has one block table
per group per request: each group gets its own layout and metadata (``GroupedMetadata``), and each layer
reads its group's layer slot of the store.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tideserve.core.kv_cache.groups import NULL_BLOCK_ID, KVCacheGroups, first_live_block
from tideserve.core.scheduler import NewRequestData, SchedulerOutput
from tideserve.model.attention import AttentionMetadata, BatchLayout, GroupedMetadata, backend_for_model
from tideserve.model.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from tideserve.outputs import Logprob
from tideserve.platform import platform_for
from tideserve.sampling_params import SamplingParams
from tideserve.spec_decode import verify
from tideserve.structured_output.backend import MatcherAfter
from tideserve.worker.cuda_graphs import DecodeGraphs, GraphCapture, cuda_graph_capture
from tideserve.worker.draft_proposer import propose_with_draft
from tideserve.worker.kv_store import CopyKVStore, KVCacheStorage

logger = logging.getLogger(__name__)


# Measured activation peaks per loaded model, by the profiling pass's shape (tokens, sequences, block size,
# attention backend, KV dtype): the peak is a property of the model and those shapes, so engines built
# again over the same loaded model (``LLM.from_loaded``, a wake from sleep) reuse the first measurement,
# which is also the most conservative one (later passes find the allocator's heap already grown).
_MEASURED_PEAKS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, int]] = weakref.WeakKeyDictionary()


@dataclass
class CachedRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    block_ids: list[int]  # with several KV cache groups: one table per group (list[list[int]])
    num_computed_tokens: int
    structured_output: Any = None  # grammar matcher: this request's samples are masked by it


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None = None


@dataclass
class PooledPart:
    """What one step adds to an embedding request's vector: MEAN pooling's sum over the ``count`` prompt
    positions from ``first`` on (float32), or the LAST/CLS position's state (``count`` 1)."""

    first: int
    count: int
    vector: torch.Tensor


@dataclass
class ModelRunnerOutput:
    # Per request that completed its tokens: its new tokens in order (one; or, verifying proposals, the
    # accepted ones and the model's token after them).
    sampled: dict[str, list[SampledToken]]
    # Per request asking for prompt logprobs: (index of the first prompt token scored, one entry per
    # prompt token scored in this step: the logprob of token i given tokens 0..i-1).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]]
    # Per embedding request whose pooled positions this step computed.
    pooled: dict[str, PooledPart] = field(default_factory=dict)
    # The draft-model method: per request that drafted after this step's token, the draft's greedy tokens for
    # the positions after it (the next step's proposals; worker/draft_proposer.py).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """Keeps the per-request batch state and runs steps over ``kv_storage``, which owns the KV tensors."""

    def __init__(self, model: torch.nn.Module, kv_storage: KVCacheStorage, device: torch.device,
                 attention_backend: str = "auto", draft_model: torch.nn.Module | None = None) -> None:
        """``draft_model``: the draft-model method's proposer, whose layers are the store's layer slots after
        the target's (worker/draft_proposer.py)."""
        self.model = model
        self.draft_model = draft_model
        self.device = device
        self.platform = platform_for(device)
        self.kv_storage = kv_storage
        self.layout = kv_storage.layout
        kv_dtype = self.kv_dtype = kv_storage.layout.dtype
        self.sampler = Sampler()
        # Chosen once (model/attention/selector.py): its kernels are bound, its builder makes each step's metadata.
        self.attn_backend = backend_for_model(attention_backend, model, kv_dtype, device)
        # The draft's own: a backend binds its kernels to the model's query heads.
        self.draft_attn_backend = (backend_for_model(attention_backend, draft_model, kv_dtype, device)
                                   if draft_model is not None else None)
        self.kv_groups: KVCacheGroups = model.arch.kv_cache_groups()
        self.hybrid = self.kv_groups.is_hybrid
        # The target's layer slots come first in the store; a draft model's follow them.
        self.num_target_slots = self.kv_groups.group_size
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded requests' generators, by request id. Kept across preemption (a resumed request draws on
        # from where it stopped, so its tokens are those of an uninterrupted run); dropped when it finishes.
        self.generators: dict[str, torch.Generator] = {}
        # Structured output: computes the token masks of requests with a grammar (set by the worker).
        self.structured_output: Any = None
        # False on tensor-parallel ranks other than the driver: they compute the logits (a collective) but
        # the driver samples, and they learn its tokens with the next step (worker/worker.py).
        self.samples = True
        # Captured decode steps (worker/cuda_graphs.py), set by enable_graphs; None: every step eager.
        self.graphs: DecodeGraphs | None = None

    def enable_graphs(self, max_num_seqs: int, max_model_len: int, capture: GraphCapture | None = None) -> bool:
        """Run decode-only steps as graphs captured per batch size (``capture``: real CUDA graphs by
        default). False, changing nothing, when the attention backend has no static decode metadata, or for a
        mixture of experts: which experts a step runs depends on its routing, read on the host, which a
        captured graph cannot follow."""
        if not self.attn_backend.graph_fields or getattr(self.model.arch, "num_experts", 0) or self.hybrid:
            return False
        self.graphs = DecodeGraphs(self.model, self.attn_backend.graph_fields, self.device, max_num_seqs,
                                   max_model_len, capture or cuda_graph_capture(self.device))
        return True

    # ----------------------------------------------------------------- KV tensors (read, never moved here)
    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V): its own, or with several KV cache groups its group's layer slot."""
        slots = self.kv_storage.caches
        return self._layer_caches(slots if self.draft_model is None else slots[:self.num_target_slots])

    @property
    def draft_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The draft model's (K, V) per layer: the store's slots after the target's."""
        return self.kv_storage.caches[self.num_target_slots:]

    def _layer_caches(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self.hybrid:
            return slots
        return [slots[j] for j in self.kv_groups.layer_slot]

    def _grouped(self, metas: list[AttentionMetadata]) -> AttentionMetadata | GroupedMetadata:
        return GroupedMetadata(metas, self.kv_groups.layer_group) if self.hybrid else metas[0]

    @property
    def block_size(self) -> int:
        return self.kv_storage.block_size

    # ----------------------------------------------------------------- profiling
    PROFILE_TOKENS = 256  # a profiling pass at this many tokens, scaled linearly to the real budget

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, max_num_seqs: int, block_size: int | None = None) -> int:
        """Peak activation memory of a forward pass over num_tokens prompt tokens (plus sampler logits).

        Measured by the platform (CUDA's allocator peak; on CPU the resident-set high-water mark after a
        reset). The pass runs at min(num_tokens, PROFILE_TOKENS) and is scaled linearly (activations grow
        linearly with tokens under memory-efficient attention). A lower bound computed from the shapes guards
        against an allocator that reuses memory the measurement cannot see.
        """
        arch = self.model.arch
        n = max(1, min(num_tokens, self.PROFILE_TOKENS))
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        per_token = (8 * arch.hidden_size + 3 * arch.intermediate_size
                     + 2 * (arch.q_size + 2 * arch.kv_size)) * elem
        logits = max_num_seqs * arch.vocab_size * 4 * 3  # logits, probabilities, sort buffers (fp32)
        estimate = num_tokens * per_token + logits

        block_size = block_size or self.block_size
        key = (n, block_size, type(self.attn_backend).__name__, str(self.layout.dtype), str(self.device))
        peaks = _MEASURED_PEAKS.setdefault(self.model, {})
        if key not in peaks:
            scratch = CopyKVStore(self.layout, self.device, block_size, -(-n // block_size), zero=True)
            meta = self.attn_backend.build_metadata(BatchLayout.single_prefill(n, block_size))
            meta = self._grouped([meta] * self.kv_groups.num_groups)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            pos = torch.arange(n, device=self.device)
            caches = self._layer_caches(scratch.caches[:self.num_target_slots])
            peaks[key] = self.platform.measure_peak_bytes(
                lambda: self.model.compute_logits(self.model(ids, pos, caches, meta)[-1:]))
        measured = int(peaks[key] * num_tokens / n) + logits
        logger.info("profiling run: %d tokens, activation peak %.1f MiB measured (scaled to %d tokens), "
                    "%.1f MiB estimated from shapes", n, measured / 2**20, num_tokens, estimate / 2**20)
        return max(measured, estimate)

    # ----------------------------------------------------------------- the elastic pool's moves
    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        """Copy moved blocks' KV (old id -> new id) and rewrite the block tables the runner keeps."""
        if not moves:
            return
        self.kv_storage.copy_blocks(moves)
        remap = dict(moves)
        for state in self.requests.values():
            if self.hybrid:
                state.block_ids = [[remap.get(b, b) for b in t] for t in state.block_ids]
            else:
                state.block_ids = [remap.get(b, b) for b in state.block_ids]

    def forget_finished(self) -> None:
        """Drop the state of requests that finished after the last step (normally dropped by the next
        step): a pool reshaped while idle leaves none of them with block ids of the old layout."""
        self.requests.clear()

    # ----------------------------------------------------------------- state from the scheduler
    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_ids:
            self.requests.pop(request_id, None)
            self.generators.pop(request_id, None)
        for request_id in out.preempted_ids:
            self.requests.pop(request_id, None)
        if self.hybrid:
            self._update_group_tables(out)
            return
        attached: list[tuple[list[int], int]] = []  # (blocks just attached, tokens already in them)
        for new in out.new_requests:
            state = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, self._generator(new),
                new.eos_token_id, list(new.block_ids), new.num_computed_tokens, new.structured_output)
            self.requests[new.request_id] = state
            # Its prefill writes every slot up to its tokens; only the last block's tail stays unwritten.
            attached.append((state.block_ids, max(state.num_computed_tokens, len(state.token_ids))))
        for cached in out.cached_requests:
            state = self.requests[cached.request_id]
            # The table the cache manager kept: ceil(computed / block size) blocks (it hands back the blocks
            # of proposals that were not accepted), then this step's.
            del state.block_ids[-(-cached.num_computed_tokens // self.block_size):]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_block_ids:
                attached.append((list(cached.new_block_ids), 0))
        self.kv_storage.clear_unwritten(attached)

    def _update_group_tables(self, out: SchedulerOutput) -> None:
        """``_update_states``' table part with one table per KV cache group. A sliding group's entries
        before its window become the null block here by the cache manager's own rule (``first_live_block``
        at the computed tokens), so the runner never reads a block the manager gave back."""
        attached: list[tuple[list[int], int]] = []
        for new in out.new_requests:
            state = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params, self._generator(new),
                new.eos_token_id, [list(t) for t in new.block_ids], new.num_computed_tokens, new.structured_output)
            self.requests[new.request_id] = state
            valid = max(state.num_computed_tokens, len(state.token_ids))
            attached.extend((t, valid) for t in state.block_ids)
        bs = self.block_size
        for cached in out.cached_requests:
            state = self.requests[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            for table, new_ids, window in zip(state.block_ids, cached.new_block_ids, self.kv_groups.windows,
                                              strict=True):
                del table[-(-cached.num_computed_tokens // bs):]  # as _update_states: rejected proposals' blocks
                table.extend(new_ids)
                if new_ids:
                    attached.append((list(new_ids), 0))
                for i in range(first_live_block(cached.num_computed_tokens, window, bs)):
                    table[i] = NULL_BLOCK_ID
        self.kv_storage.clear_unwritten(attached)

    def _generator(self, new: NewRequestData) -> torch.Generator | None:
        """The request's generator: made from its seed until it has sampled a token (first scheduled, or
        preempted before its first token: nothing drawn yet), then the same one when it resumes."""
        if new.seed is None:
            return None
        generator = self.generators.get(new.request_id)
        if generator is None or len(new.token_ids) == new.num_prompt_tokens:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.seed)
            self.generators[new.request_id] = generator
        return generator

    # ----------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the target's forward pass, sampling and verification; then, with a draft model, the
        draft's pass over the same rows and its proposals for the next step."""
        result = self._execute_target(out)
        if self.draft_model is not None and not out.is_empty:
            result.draft_token_ids = propose_with_draft(self, out, result.sampled)
        return result

    def _execute_target(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Copies first: blocks swapped out in this step may be rewritten by this step's forward pass.
        self.kv_storage.swap_out(out.swap_out)
        self.kv_storage.swap_in(out.swap_in)
        self._update_states(out)
        result = ModelRunnerOutput({}, {})
        if out.is_empty:
            return result
        # Decodes sorted by context length, so attention can take them in groups of similar length; then the
        # requests verifying proposals, then prefills.
        spec = out.spec_token_ids
        decode_ids = sorted((rid for rid, n in out.num_scheduled_tokens.items() if n == 1),
                            key=lambda rid: self.requests[rid].num_computed_tokens)
        spec_ids = [rid for rid in out.num_scheduled_tokens if rid in spec]
        prefill_ids = [rid for rid, n in out.num_scheduled_tokens.items() if n > 1 and rid not in spec]
        order = decode_ids + spec_ids + prefill_ids
        pieces = [(rid, self.requests[rid].num_computed_tokens, out.num_scheduled_tokens[rid]) for rid in order]
        for rid, drafts in spec.items():  # the proposals are this step's input after the last token
            self.requests[rid].token_ids.extend(drafts)
        sample_rows, sample_ids = self._sample_rows(pieces, spec)
        pending_mask = self._start_masks(sample_ids, spec)  # may run on a worker thread during the forward pass

        # A request verifying proposals runs as one decode row per token, each attending the keys up to its
        # own position (every row's key is stored before any row attends): the decode path, and a query
        # gets the bits it would get in a prefill.
        num_rows = len(decode_ids) + sum(out.num_scheduled_tokens[rid] for rid in spec_ids)
        rows = [(rid, start + j, 1) for rid, start, count in pieces[:len(decode_ids) + len(spec_ids)]
                for j in range(count)]
        forward_pieces = rows + pieces[len(decode_ids) + len(spec_ids):]
        slab = self.platform.forward_slab_tokens
        if prefill_ids and slab is not None and out.total_num_scheduled_tokens > slab:
            decodes = set(decode_ids) | set(spec_ids)
            hidden = torch.cat([self._forward(part, sum(1 for rid, _, _ in part if rid in decodes))
                                for part in self._slabs(forward_pieces, slab)])
        else:
            hidden = self._forward(forward_pieces, num_rows, graphs=not prefill_ids)
        self._prompt_logprobs(order, out.num_scheduled_tokens, hidden, result)
        self._pool(order, out.num_scheduled_tokens, hidden, result)
        for rid in order:
            self.requests[rid].num_computed_tokens += out.num_scheduled_tokens[rid]
        if not sample_ids:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])
        if not self.samples:
            for rid, drafts in spec.items():  # the driver's tokens come with the next step
                del self.requests[rid].token_ids[-len(drafts):]
            return result
        states = [self.requests[rid] for rid in sample_ids]
        # A request verifying proposals has one row per position: row i sees its outputs with the first i
        # proposals appended (penalties and min_tokens count them), as an unspeculated step would.
        outputs, position = [], 0  # position: the row's index among its request's rows
        for i, (rid, state) in enumerate(zip(sample_ids, states)):
            position = position + 1 if i and sample_ids[i - 1] == rid else 0
            end = len(state.token_ids) - len(spec.get(rid, ())) + position
            outputs.append(state.token_ids[state.num_prompt_tokens:end])
        sampling_meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in states],
            output_token_ids=outputs,
            eos_token_ids=[s.eos_token_id for s in states],
            device=self.device,
        )
        if pending_mask is not None:
            sampling_meta.allowed_token_mask = pending_mask.result()
        draws = verify.generator_states(spec, self.requests)
        sampled = self.sampler(logits, sampling_meta)
        token_ids = sampled.sampled_token_ids
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        row = 0
        for rid in dict.fromkeys(sample_ids):
            state = self.requests[rid]
            drafts = spec.get(rid, ())
            if drafts:
                del state.token_ids[-len(drafts):]
            rows = len(drafts) + 1
            kept = verify.accepted_length(token_ids[row:row + rows], drafts) + 1
            if drafts:
                verify.replay_draws(draws.get(rid), kept, logits.shape[-1])
            tokens = []
            for r in range(row, row + kept):
                token = int(token_ids[r])
                state.token_ids.append(token)
                tokens.append(SampledToken(token, sampled.logprobs[r] if sampled.logprobs is not None else None))
            result.sampled[rid] = tokens
            row += rows
        return result

    def _start_masks(self, sample_ids: list[str], spec: dict[str, list[int]]):
        """The allowed-token masks of the rows about to be sampled that follow a grammar, or None.

        Their matchers were advanced after the previous step's sampling, so the masks can be computed
        before (or while) this step's forward pass runs. A request verifying proposals has a mask per row,
        each the grammar's after the proposals before that row.
        """
        rows = []
        for row, rid in enumerate(sample_ids):
            matcher = self.requests[rid].structured_output
            if matcher is None or not matcher.active:
                continue
            before = 0 if rid not in spec else row - sample_ids.index(rid)  # proposals before this row
            rows.append((row, MatcherAfter(matcher, spec[rid][:before]) if before else matcher))
        if not rows:
            return None
        return self.structured_output.compute(rows, self.device)

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

    def _pool(self, order: list[str], num_scheduled: dict[str, int], hidden: torch.Tensor,
              result: ModelRunnerOutput) -> None:
        """Reduce embedding requests' rows of this step to what their pooling keeps (kept small: one vector
        per request leaves the device)."""
        start = 0
        for rid in order:
            n = num_scheduled[rid]
            state = self.requests[rid]
            pooling = state.sampling_params.pooling
            if pooling is not None:
                first = state.num_computed_tokens
                rows = hidden[start:start + n]
                if pooling.pooling_type == "MEAN":
                    part = PooledPart(first, n, rows.float().sum(dim=0))
                elif pooling.pooling_type == "CLS":
                    part = PooledPart(0, 1, rows[0].float()) if first == 0 else None
                else:  # LAST: the step that reaches the prompt's end
                    part = (PooledPart(first + n - 1, 1, rows[-1].float())
                            if first + n >= state.num_prompt_tokens else None)
                if part is not None:
                    part.vector = part.vector.cpu()
                    result.pooled[rid] = part
            start += n

    @staticmethod
    def _slabs(pieces: list[tuple[str, int, int]], limit: int) -> list[list[tuple[str, int, int]]]:
        """The step's pieces (request id, first position, tokens) cut into consecutive slabs of at most
        ``limit`` tokens; a request cut in two continues at the start of the next slab."""
        slabs: list[list[tuple[str, int, int]]] = [[]]
        room = limit
        for rid, start, count in pieces:
            while count > 0:
                if room == 0:
                    slabs.append([])
                    room = limit
                take = min(count, room)
                slabs[-1].append((rid, start, take))
                start, count, room = start + take, count - take, room - take
        return slabs

    def _sample_rows(self, pieces: list[tuple[str, int, int]],
                     spec: dict[str, list[int]]) -> tuple[torch.Tensor, list[str]]:
        """Rows of the step's flat batch to sample from (each request whose tokens the step completes: its
        last row, and the rows of its proposals before it), and their request ids (one per row)."""
        rows, ids, end = [], [], 0
        for rid, start, count in pieces:
            end += count
            if start + count >= len(self.requests[rid].token_ids):
                num = len(spec.get(rid, ())) + 1
                rows.extend(range(end - num, end))
                ids.extend([rid] * num)
        return torch.tensor(rows, dtype=torch.long, device=self.device), ids

    def _forward(self, pieces: list[tuple[str, int, int]], num_decodes: int, graphs: bool = False,
                 draft: bool = False) -> torch.Tensor:
        """Final hidden states of one forward pass over ``pieces`` (request id, first position, tokens),
        the first ``num_decodes`` of them single-token decodes; ``graphs``: a decode-only pass may replay a
        captured graph; ``draft``: the draft model's pass over its own layers (eager)."""
        if self.hybrid:
            return self._forward_groups(pieces, num_decodes)
        max_blocks = max(len(self.requests[rid].block_ids) for rid, _, _ in pieces)
        tables = np.zeros((len(pieces), max_blocks), dtype=np.int64)
        input_ids = np.empty(sum(count for _, _, count in pieces), dtype=np.int64)
        offset = 0
        for i, (rid, start, count) in enumerate(pieces):
            state = self.requests[rid]
            tables[i, :len(state.block_ids)] = state.block_ids
            input_ids[offset:offset + count] = state.token_ids[start:start + count]
            offset += count
        layout = BatchLayout(tables, np.array([p[1] for p in pieces], dtype=np.int64),
                             np.array([p[2] for p in pieces], dtype=np.int64), num_decodes, self.block_size)
        meta = (self.draft_attn_backend if draft else self.attn_backend).build_metadata(layout)
        ids = torch.from_numpy(input_ids).to(self.device)
        positions = torch.from_numpy(layout.positions).to(self.device)
        hidden = None
        if graphs and self.graphs is not None:
            caches = self.kv_storage.graph_caches  # the same list each step unless the store changes
            if self.draft_model is not None:
                caches = caches[:self.num_target_slots]
            hidden = self.graphs.run(ids, positions, meta, caches, self.block_size)
        if hidden is None and draft:
            hidden = self.draft_model(ids, positions, self.draft_kv_caches, meta)
        elif hidden is None:
            hidden = self.model(ids, positions, self.kv_caches, meta)
        return hidden

    def _forward_groups(self, pieces: list[tuple[str, int, int]], num_decodes: int) -> torch.Tensor:
        """``_forward`` with one block table per KV cache group: a layout and metadata per group (the same
        tokens and positions, each group's own tables and slot mapping), each layer attending with its
        group's. Every entry a sliding group's query may read is a live block (the null block only sits
        wholly before the window), and the null block is zeroed, so masked reads add exactly 0."""
        self.kv_storage.zero_block(NULL_BLOCK_ID)
        states = [self.requests[rid] for rid, _, _ in pieces]
        width = max(len(s.block_ids[0]) for s in states)
        num_computed = np.array([p[1] for p in pieces], dtype=np.int64)
        query_lens = np.array([p[2] for p in pieces], dtype=np.int64)
        input_ids = np.empty(int(query_lens.sum()), dtype=np.int64)
        offset = 0
        for state, (_, start, count) in zip(states, pieces):
            input_ids[offset:offset + count] = state.token_ids[start:start + count]
            offset += count
        metas, positions = [], None
        for g in range(self.kv_groups.num_groups):
            tables = np.zeros((len(pieces), width), dtype=np.int64)
            for i, state in enumerate(states):
                tables[i, :len(state.block_ids[g])] = state.block_ids[g]
            layout = BatchLayout(tables, num_computed, query_lens, num_decodes, self.block_size)
            metas.append(self.attn_backend.build_metadata(layout))
            positions = layout.positions
        ids = torch.from_numpy(input_ids).to(self.device)
        return self.model(ids, torch.from_numpy(positions).to(self.device), self.kv_caches, self._grouped(metas))
