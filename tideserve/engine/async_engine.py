"""The engine for servers: ``LLMEngine``'s step loop in a dedicated thread, streamed to asyncio callers.

Why a thread: a step runs the model for tens to hundreds of milliseconds; run on the event loop it would
stall every HTTP connection. The engine thread is the only one that touches the ``LLMEngine`` (its
scheduler, KV cache and runner are not thread-safe): callers submit "add" and "abort" commands to a
queue, and the thread applies them between steps, so a validation error still reaches the caller (the
command carries a future) and an abort frees the request's blocks before the next step.

Outputs are cumulative, so a stream keeps only the newest one: a slow reader skips intermediate
outputs instead of queueing them, and never loses text, tokens or logprobs.

If the loop dies (an exception in ``step``), every pending request gets ``EngineDeadError`` instead of
hanging, new requests are refused, and ``is_healthy`` turns False (the server's /health answers 503).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tideserve.engine.input_processor import EngineRequest
from tideserve.engine.stat_logger import StatLogger
from tideserve.engine.stats import EngineStats
from tideserve.outputs import RequestOutput
from tideserve.pooling_params import PoolingParams
from tideserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often, at most, the engine thread refreshes its stats snapshot while busy (it always does when idle):
# a snapshot probes memory (about 0.5 ms), too much to pay every step.
_STATS_INTERVAL_S = 0.1
# How long the idle engine thread sleeps between checks when no command arrives; each wake-up runs the
# KV pool's upkeep, so an idle server gives memory back on time (the pool is touched by this thread only).
_IDLE_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it crashed or was shut down); the request cannot be served."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``; the caller should retry later (HTTP 429)."""


class RequestStream:
    """The outputs of one request, as an async iterator; only the newest (cumulative) output is kept.

    Iteration ends after the finished output, or quietly (``aborted`` set) after an abort; it raises
    ``EngineDeadError`` if the engine loop dies first.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # a finished output was delivered, or the stream ended otherwise
        self.aborted = False

    # ---------------------------------------------------------------- called on the event loop
    def _put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        self._latest = output
        if output.finished:
            self._end()
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self._end()
            self._event.set()

    def _abort(self) -> None:
        if not self.finished:
            self.aborted = True
            self._end()
            self._event.set()

    def _end(self) -> None:
        self.finished = True
        self._engine._release(self.request_id, self)

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self._engine.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._latest is None:
            if self._error is not None:
                raise self._error
            if self.finished:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
        out, self._latest = self._latest, None
        return out


@dataclass
class _Add:
    request: EngineRequest  # checked by the input processor; its request_id is set
    stream: RequestStream
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps (sleep mode); its result or error goes back."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncEngine:
    """Thread-safe, asyncio-facing wrapper of an ``LLMEngine`` (see the module docstring).

    ``max_queue`` caps the requests waiting to be scheduled (those submitted and not yet applied
    included); beyond it ``add_request`` raises ``QueueFullError``.
    """

    def __init__(self, engine, *, max_queue: int | None = None, log_stats_interval: float | None = 5.0,
                 stats_listeners: Sequence = ()) -> None:
        if max_queue is not None and (not isinstance(max_queue, int) or max_queue < 1):
            raise ValueError(f"max_queue must be an integer >= 1 (or None for no cap), got {max_queue!r}.")
        self.engine = engine
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._commands: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._pending_adds = 0  # adds queued, not yet applied (guarded by _cond)
        self._active: dict[str, RequestStream] = {}  # ids in use, from submission to the end of the stream
        self._active_lock = threading.Lock()
        self._targets: dict[str, RequestStream] = {}  # engine thread only: admitted requests
        self._dead: BaseException | None = None
        self._stopping = False
        self._stats: EngineStats = engine.stats()
        self._num_waiting = engine.num_waiting_requests()
        self._stats_time = 0.0
        self._busy_since: float | None = None  # monotonic start of the step (or pool upkeep) now running
        self._stats_listeners = list(stats_listeners)
        self._stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._thread = threading.Thread(target=self._run, name="tideserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args, **kwargs) -> AsyncEngine:
        """Load the model (slow: seconds) and start the loop; ``args`` is an EngineArgs or a dict of its
        fields, as vLLM's ``AsyncLLMEngine.from_engine_args`` takes."""
        from tideserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(args), **kwargs)

    @classmethod
    def from_loaded(cls, args, loaded, tokenizer=None, **kwargs) -> AsyncEngine:
        """Start the loop over an already loaded model (``load_model``) and tokenizer, shared with any other
        engine built on them; ``args`` as for ``from_engine_args`` (``LLMEngine.from_loaded``)."""
        from tideserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_loaded(args, loaded, tokenizer), **kwargs)

    # ---------------------------------------------------------------- read-only views
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def scheduling_policy(self) -> str:
        return self.engine.scheduler_config.scheduling_policy

    @property
    def structured_output(self):
        """The engine's grammar compiler and mask computation; ``compile`` is thread-safe (and cached), so
        the server compiles a request's constraint off the engine thread before submitting it."""
        return self.engine.structured_output

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    def cache_info(self) -> dict[str, str]:
        """vLLM's ``cache_config_info`` labels: the KV cache's settings as the server reports them."""
        cache = self.engine.cache_config
        return {"block_size": str(cache.block_size), "num_gpu_blocks": str(self._stats.kv_cache_pool_blocks),
                "enable_prefix_caching": str(cache.enable_prefix_caching)}

    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """The engine's own prompt validation and tokenization; read-only, so safe from any thread."""
        return self.engine.input_processor.tokenize_prompt(prompt, add_special_tokens)

    def embedding_only_message(self, api: str = "generation") -> str | None:
        """Why this model cannot serve ``api`` (it has no language-model head), or None when it can."""
        if self.engine.arch.generates:
            return None
        return self.engine.input_processor.embedding_only_message(api)

    def process_inputs(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams | None = None,
                       request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                       priority: int = 0, cache_salt: str | None = None, *, names: Mapping[str, str] | None = None,
                       max_n: int | None = None) -> EngineRequest:
        """Every check of a request, as the offline API makes them (``InputProcessor.process``); read-only,
        so any thread may call it (a long prompt is best tokenized off the event loop)."""
        return self.engine.input_processor.process(prompt, params, request_id, prompt_token_ids, priority,
                                                   cache_salt, names=names, max_n=max_n)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopping and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def step_running_for(self) -> float:
        """Seconds the engine thread has spent in the step (or pool upkeep) it is running now; 0 between
        steps. A step that never returns (a hung device, a deadlock) shows here long before any request
        times out, so the server's /health can report it (``--engine-stall-timeout``)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def stats(self) -> EngineStats:
        """The latest snapshot, taken by the engine thread (never older than one step when busy)."""
        return self._stats

    def add_stats_listener(self, listener) -> None:
        """``listener(stats)`` is called on the engine thread after each snapshot; keep it cheap."""
        self._stats_listeners.append(listener)

    def queue_depth(self) -> int:
        """Requests waiting to be scheduled: submitted but not applied, plus the scheduler's queue."""
        with self._cond:
            return self._pending_adds + self._num_waiting

    def num_active(self) -> int:
        with self._active_lock:
            return len(self._active)

    # ---------------------------------------------------------------- submission (any thread, asyncio)
    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams,
                          request_id: str | None = None,
                          prompt_token_ids: list[int] | None = None, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Check and submit a request; returns its stream once the engine accepted it (``priority`` and
        ``cache_salt`` as in ``LLMEngine.add_request``).

        Raises the input processor's ``ValueError`` for invalid input (and for a duplicate ``request_id``),
        ``QueueFullError`` at ``max_queue`` and ``EngineDeadError`` when the loop is not running.
        """
        self._check_alive()
        request = await asyncio.to_thread(self.process_inputs, prompt, params, request_id, prompt_token_ids,
                                          priority, cache_salt)
        return await self.add(request)

    async def add(self, request: EngineRequest) -> RequestStream:
        """Submit a request the input processor checked (``process_inputs``); returns its stream once the
        engine thread has queued it (errors as for ``add_request``)."""
        self._check_alive()
        request_id = request.request_id = request.request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, asyncio.get_running_loop(), self)
        with self._active_lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self._active[request_id] = stream
        command = _Add(request, stream)
        with self._cond:
            depth = self._pending_adds + self._num_waiting
            if self.max_queue is not None and depth >= self.max_queue:
                self._release(request_id, stream)
                raise QueueFullError(
                    f"The server's waiting queue is full ({depth} requests waiting, "
                    f"max_queue={self.max_queue}); retry later.")
            self._pending_adds += 1
            self._commands.append(command)
            self._cond.notify()
        try:
            await asyncio.wrap_future(command.future)
        except asyncio.CancelledError:
            # The caller went away while the command was queued: the add is skipped if not yet applied,
            # and aborted right after otherwise (commands are applied in order).
            command.future.cancel()
            self.abort(request_id)
            self._release(request_id, stream)
            raise
        except BaseException:
            self._release(request_id, stream)
            raise
        return stream

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.add_request(prompt, params, request_id, prompt_token_ids, priority, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # ---------------------------------------------------------------- sleep mode (any thread, asyncio)
    @property
    def is_sleeping(self) -> bool:
        """Whether the engine is asleep (read without waiting for the engine thread)."""
        return self.engine.is_sleeping()

    @property
    def sleep_level(self) -> int:
        return self.engine.sleep_level

    @property
    def sleep_mode_enabled(self) -> bool:
        return self.engine.model_config.enable_sleep_mode

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` on the engine thread, between steps: refused (``EngineBusyError``) while any
        request is in flight, those submitted and not yet applied included."""
        await self._call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``LLMEngine.wake_up`` on the engine thread."""
        await self._call(lambda engine: engine.wake_up(tags))

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        self._check_alive()
        command = _Call(fn)
        with self._cond:
            self._commands.append(command)
            self._cond.notify()
        return await asyncio.wrap_future(command.future)

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step); unknown ids are ignored."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running end with ``EngineDeadError``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for stop in (getattr(self.engine, "close", None),  # the KV events publisher (test doubles may have none)
                     getattr(self.engine, "shutdown", None)):  # a tensor-parallel engine's ranks stop with it
            if stop is not None:
                stop()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"The engine loop has died ({type(self._dead).__name__}: {self._dead}).")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("The engine is shut down.")

    def _release(self, request_id: str, stream: RequestStream) -> None:
        """Free the id, unless a newer request already reuses it."""
        with self._active_lock:
            if self._active.get(request_id) is stream:
                del self._active[request_id]

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        try:
            while True:
                commands = self._take_commands()
                if commands is None:
                    break
                for command in commands:
                    self._apply(command)
                self._count_applied(sum(isinstance(c, _Add) for c in commands))
                outputs: list[RequestOutput] = []
                self._busy_since = step_start = time.monotonic()
                try:
                    if self.engine.has_unfinished_requests():
                        outputs = self.engine.step()
                        for out in outputs:
                            out.metrics.setdefault("step_start_time", step_start)
                    else:
                        self.engine.maintain()
                finally:
                    self._busy_since = None
                self._set_num_waiting()
                # Snapshot first: a client that scrapes /metrics right after its response sees its tokens.
                self._snapshot(force=not self.engine.has_unfinished_requests())
                self._deliver(outputs)
            self._fail_all(EngineDeadError("The engine is shut down."))
        except BaseException as exc:
            logger.exception("The engine loop died; pending requests fail and /health reports 503")
            self._dead = exc
            self._fail_all(EngineDeadError(f"The engine loop has died ({type(exc).__name__}: {exc})."))

    def _take_commands(self) -> list[_Add | _Abort | _Call] | None:
        """Queued commands (waiting up to _IDLE_WAIT_S for one while idle: the caller then runs the pool's
        upkeep); None when the loop should stop."""
        with self._cond:
            if not self._commands and not self._stopping and not self.engine.has_unfinished_requests():
                self._cond.wait(_IDLE_WAIT_S)
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:  # the caller gets it; the engine goes on
                    command.future.set_exception(exc)
            return
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            stream = self._targets.pop(command.request_id, None)
            if stream is not None:
                self._post(stream.loop, [(stream, "abort")])
            return
        if not command.future.set_running_or_notify_cancel():
            return  # the caller gave up before the request was applied
        try:
            self.engine.add(command.request)
        except Exception as exc:  # the caller gets it; the engine is unchanged
            command.future.set_exception(exc)
            return
        self._targets[command.request.request_id] = command.stream
        command.future.set_result(None)

    def _count_applied(self, num_adds: int) -> None:
        """Move applied adds from the pending count to the scheduler's queue in one step (no gap)."""
        if num_adds:
            waiting = self.engine.num_waiting_requests()
            with self._cond:
                self._pending_adds -= num_adds
                self._num_waiting = waiting

    def _set_num_waiting(self) -> None:
        """The scheduler's queue length, read every step: cheap, unlike a full stats snapshot."""
        waiting = self.engine.num_waiting_requests()
        with self._cond:
            self._num_waiting = waiting

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams, one wake-up per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._targets.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._targets[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            self._post(loop, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
            self._pending_adds = 0
        for command in commands:
            if isinstance(command, _Add | _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in self._targets.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        self._targets.clear()
        for loop, items in by_loop.items():
            self._post(loop, items)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_dispatch, items)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            logger.debug("dropping %d outputs for a closed event loop", len(items))

    def _snapshot(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._stats_time < _STATS_INTERVAL_S:
            return
        self._stats_time = now
        stats = self.engine.stats()
        self._stats = stats
        for listener in self._stats_listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("stats listener %r failed", listener)
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(stats, now)


def _dispatch(items: list) -> None:
    """Runs on the caller's event loop: route outputs, aborts and errors to their streams."""
    for stream, item in items:
        if isinstance(item, RequestOutput):
            stream._put(item)
        elif isinstance(item, BaseException):
            stream._fail(item)
        else:
            stream._abort()


class AsyncLLMEngine(AsyncEngine):
    """vLLM's name for the asyncio-facing engine, so ``AsyncLLMEngine.from_engine_args({...})`` and
    ``async for out in engine.generate(prompt, params, request_id)`` run unchanged."""
