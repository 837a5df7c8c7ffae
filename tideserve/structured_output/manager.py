"""One step's token masks for the whole batch, and the engine's grammar compiler.

The model runner asks for the masks of the rows it will sample (``compute``), gets one int32 bitmask
tensor ``[rows with a grammar, bitmask_width(vocab)]`` and hands it to the sampler, which applies it in
one place (``apply_allowed_token_mask`` in tideserve/model/layers/sampler.py). The masks are filled by
llguidance's thread pool, with the GIL released.

``overlap=True`` computes them on a worker thread while the model's forward pass runs (the matchers were
advanced after the previous step's sampling, so their state is final): measured on the 2-core dev
machine (docs/structured-output.md), the mask work is small next to a forward pass and the thread
competes with torch's own threads for the same cores, so it is off by default.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

import torch

from tideserve.model.layers.sampler import AllowedTokenMask
from tideserve.platform import platform_for
from tideserve.structured_output.backend import CompiledGrammar, GrammarCompiler, GrammarMatcher, bitmask_width
from tideserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class PendingMask:
    """A mask being computed (on a worker thread, or already done); ``result()`` waits for it."""

    def __init__(self, future: concurrent.futures.Future | None, value: AllowedTokenMask | None = None) -> None:
        self._future = future
        self._value = value

    def result(self) -> AllowedTokenMask:
        return self._future.result() if self._future is not None else self._value


class StructuredOutputManager:
    """The engine's grammar compiler plus the per-step bitmask computation (see the module docstring)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 overlap: bool = False, num_threads: int | None = None) -> None:
        self.compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._num_threads = num_threads
        self._executor = None  # llguidance.LLExecutor, created on first use
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._buffer_rows = torch.empty(0, bitmask_width(self.compiler.vocab_size), dtype=torch.int32)

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> CompiledGrammar:
        return self.compiler.compile(params, timeout_s)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """Reused every step: a step's mask is read by its sampler before the next step fills it."""
        if self._buffer_rows.shape[0] < num_rows:
            size = max(num_rows, 2 * self._buffer_rows.shape[0], 8)
            self._buffer_rows = torch.empty(size, self._buffer_rows.shape[1], dtype=torch.int32)
        return self._buffer_rows[:num_rows]

    def compute(self, rows: Sequence[tuple[int, GrammarMatcher]], device: torch.device) -> PendingMask:
        """Start computing the masks of ``rows`` ((batch row, matcher) pairs): on the worker thread when
        ``overlap``, else now."""
        rows = list(rows)
        if not self.overlap:
            return PendingMask(None, self._fill(rows, device))
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tideserve-mask")
        return PendingMask(self._worker.submit(self._fill, rows, device))

    def _fill(self, rows: list[tuple[int, GrammarMatcher]], device: torch.device) -> AllowedTokenMask:
        bitmask = self._buffer(len(rows))
        # A matcher without a native handle (a reasoning gate that adds or forces tokens) fills its own row.
        batched = [(m.handle, i) for i, (_, m) in enumerate(rows) if m.handle is not None]
        if len(batched) == 1:
            rows[batched[0][1]][1].fill_bitmask(bitmask, batched[0][1])
        elif batched:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
            self._executor.unsafe_compute_mask_ptr(batched, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
        for i, (_, m) in enumerate(rows):
            if m.handle is None:
                m.fill_bitmask(bitmask, i)
        if not platform_for(device).host_memory:
            bitmask = bitmask.to(device, non_blocking=False)
        return AllowedTokenMask([row for row, _ in rows], bitmask)

    def shutdown(self) -> None:
        self.compiler.shutdown()
        if self._worker is not None:
            self._worker.shutdown(wait=False)
