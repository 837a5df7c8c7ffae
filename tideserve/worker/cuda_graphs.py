"""Decode-only steps captured once per batch size and replayed as one graph (CUDA graphs).

Why: on a GPU a small model's decode step is bound by launching its kernels (several per layer, hundreds
per step), not by their arithmetic; a captured graph launches the whole forward pass at once. Prefill
steps vary in shape every time and stay eager, as in vLLM; so does every step under ``--enforce-eager``.

How a step runs as a graph:
- Sizes: a decode batch of ``n`` requests runs as the smallest captured size ``>= n`` (``capture_sizes``);
  larger batches run eagerly.
- Static buffers: the graph reads its inputs from fixed tensors (token ids, positions, and the attention
  backend's per-row metadata, ``AttentionBackend.graph_fields``), so a step copies its batch into them.
  Block tables are as wide as ``max_model_len`` needs, so any context fits.
- Padding: the rows past ``n`` repeat the last real row (same token, position, slot and block table),
  so they write the very K/V that row writes, to the same slot, and their outputs are dropped.
- Validity: a graph holds what its kernels were launched with: every layer's K and V address, shape and
  strides (torch's indexed stores also bake the cache's first dimension in, as a bounds check) and the
  block size (the block tables' width). The runner hands it the store's ``fixed_caches`` where the store
  has them (a mapped range: each layer's K and V over its whole region, at addresses and shapes no resize
  changes), so the pool grows and shrinks under captured graphs. Only when what a graph holds changes (a
  copying store's resize reallocates; a block-size change reshapes every view) are the graphs dropped and
  each size captured again at its next step.
- Capture is lazy (a size is captured the first time a batch needs it) and warmed up once eagerly first
  (Triton compiles its kernels, cuBLAS picks its algorithms) so nothing but kernel launches is recorded.

``capture`` is injectable: tests on the CPU pass ``eager_capture``, which runs the same buffers, padding,
invalidation and size choice without a graph, so the mechanism is tested where CUDA is absent.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch

from tideserve.model.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

# capture(fn) -> (replay, out): after replay(), ``out`` holds what fn() would return now.
GraphCapture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]

MAX_CAPTURE_SIZE = 256  # vLLM's default ceiling too: beyond it, launches are a small share of a step


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (capped at 256), and the cap itself."""
    top = max(1, min(max_num_seqs, MAX_CAPTURE_SIZE))
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


def cuda_graph_capture(device: torch.device) -> GraphCapture:
    """Real CUDA graphs sharing one memory pool (sizes are captured largest-first in use, so the pool is
    reused across them). torch frees a private pool with the last graph that uses it, and capturing into a
    freed pool's handle fails an allocator assertion; so once every graph was dropped (the KV cache
    changed), the next capture starts a fresh pool."""
    live: weakref.WeakSet[torch.cuda.CUDAGraph] = weakref.WeakSet()
    pool = None

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        nonlocal pool
        if pool is None or not live:
            pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: compile, pick algorithms, outside the capture
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        live.add(graph)
        return graph.replay, out

    return capture


def kv_key(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> tuple:
    """What a captured step depends on in the KV caches: the block size and, per layer, K's and V's
    address, shape and strides."""
    return (block_size, tuple((t.data_ptr(), tuple(t.shape), t.stride()) for pair in kv_caches for t in pair))


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """The same contract without a graph: replay re-runs fn over the same static buffers."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


@dataclasses.dataclass
class _Captured:
    replay: Callable[[], None]
    out: torch.Tensor


class DecodeGraphs:
    """The captured decode steps of one runner; ``run`` returns None when a step must run eagerly."""

    def __init__(self, model: torch.nn.Module, graph_fields: tuple[str, ...], device: torch.device,
                 max_num_seqs: int, max_model_len: int, capture: GraphCapture) -> None:
        if not graph_fields:
            raise ValueError("this attention backend has no static decode metadata to capture")
        self.model = model
        self.fields = graph_fields
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self._capture = capture
        self._graphs: dict[int, _Captured] = {}
        self._key: tuple | None = None
        self._seen: list | None = None  # the caches list the key was last computed for
        self._buffers: dict[str, torch.Tensor] = {}
        self.num_captures = 0
        self.num_replays = 0
        self.num_invalidations = 0  # times the captured graphs were dropped because the KV tensors changed

    def size_for(self, num_rows: int) -> int | None:
        return next((s for s in self.sizes if s >= num_rows), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> torch.Tensor | None:
        """The hidden states [n, hidden] of a decode-only step, from its graph; None to run it eagerly."""
        n = int(input_ids.shape[0])
        size = self.size_for(n)
        if size is None or n == 0 or meta.num_decode_tokens != n:
            return None
        if kv_caches is not self._seen or block_size != (self._key or (None,))[0]:
            key = kv_key(kv_caches, block_size)
            self._seen = kv_caches
            if key != self._key:  # the caches moved or changed shape, or the block size changed
                if self._graphs:
                    self.num_invalidations += 1
                    logger.info("CUDA graphs: the KV tensors changed (%d blocks of %d tokens); %d graphs dropped, "
                                "recaptured on use", kv_caches[0][0].shape[0], block_size, len(self._graphs))
                self._graphs.clear()
                self._buffers = self._allocate(input_ids, meta, block_size)
                self._key = key
        self._fill(input_ids, positions, meta, n, size)
        captured = self._graphs.get(size)
        if captured is None:
            captured = self._record(size, kv_caches, meta)
            self._graphs[size] = captured
            self.num_captures += 1
        captured.replay()
        self.num_replays += 1
        return captured.out[:n]

    # ----------------------------------------------------------------- static buffers
    def _allocate(self, input_ids: torch.Tensor, meta: AttentionMetadata, block_size: int) -> dict[str, torch.Tensor]:
        rows = self.sizes[-1]
        width = -(-self.max_model_len // block_size)
        buffers = {"input_ids": torch.zeros(rows, dtype=input_ids.dtype, device=self.device),
                   "positions": torch.zeros(rows, dtype=torch.int64, device=self.device)}
        for name in self.fields:
            t = getattr(meta, name)
            shape = (rows, width) if t.dim() == 2 else (rows, *t.shape[1:])
            buffers[name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
        return buffers

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, n: int,
              size: int) -> None:
        """Rows [0, n) from this step, rows [n, size) repeating row n - 1."""
        sources = {"input_ids": input_ids, "positions": positions}
        sources.update({name: getattr(meta, name) for name in self.fields})
        for name, src in sources.items():
            buf = self._buffers[name]
            if src.dim() == 2:
                buf[:n, :src.shape[1]].copy_(src)
                buf[:size, src.shape[1]:].zero_()  # never read (past every context), kept deterministic
                buf[n:size, :src.shape[1]].copy_(src[n - 1:n].expand(size - n, -1))
            else:
                buf[:n].copy_(src)
                buf[n:size].copy_(src[n - 1:n].expand(size - n, *src.shape[1:]))

    def _record(self, size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> _Captured:
        views = {name: self._buffers[name][:size] for name in self.fields}
        static_meta = dataclasses.replace(meta, num_decode_tokens=size, **views)
        if hasattr(static_meta, "decode_max_context_len"):  # a fixed bound: no device read inside the graph
            static_meta.decode_max_context_len = self.max_model_len
        ids, pos = self._buffers["input_ids"][:size], self._buffers["positions"][:size]
        replay, out = self._capture(lambda: self.model(ids, pos, kv_caches, static_meta))
        logger.debug("CUDA graphs: captured a decode step of %d rows", size)
        return _Captured(replay, out)
