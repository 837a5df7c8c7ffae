"""Publishing KV cache events in vLLM's KV-events format (``--kv-events-config``).

The KV cache manager records what its prefix cache gains and loses (tideserve/core/kv_cache/events.py);
the engine drains that list once per step (and after idle maintenance, which may shrink the pool) and
hands it to a publisher here. The ZMQ publisher does everything else on its own thread: encoding,
sending, and answering replay requests, so the engine loop never waits on a socket. A full queue drops
the batch (counted, and logged) rather than block a step.

Wire format, as vLLM's ``vllm/distributed/kv_events.py`` (msgspec msgpack):
- a ZMQ PUB socket sends three frames per batch: ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
  counter from 0, ``payload`` a ``KVEventBatch`` array ``[ts, [event, ...]]`` (``data_parallel_rank``
  omitted while it is the default);
- each event, with ``event_encoding`` "map" (the default: current vLLM, and what vllm-router 0.1.17's
  ``kv_aware`` decodes), is a map tagged by ``"type"``: ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``, ``{"type":
  "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``; with "array" (vLLM's
  original layout) the same fields as a positional array led by the tag;
- the optional ROUTER replay socket takes ``[identity, b"", start_seq]`` and answers with every buffered
  ``[identity, b"", seq, payload]`` from ``start_seq`` on, then ``[identity, b"", -1 (8 bytes), b""]``.

As in vLLM, an endpoint with a wildcard (``tcp://*:5557``), ``::``, ``ipc://`` or ``inproc://`` is bound,
any other is connected to (a subscriber that binds). pyzmq and msgspec are imported only when enabled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Protocol

from tideserve.config import KVEventsConfig
from tideserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
START_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 2.0


class EventPublisher(Protocol):
    def publish(self, events: list[KVCacheEvent]) -> None: ...

    def shutdown(self) -> None: ...


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher | None:
    """The publisher ``config`` asks for, or None when events are off (the manager then records nothing)."""
    if config is None or not config.enabled:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)


def _wire_types(event_encoding: str) -> dict[str, Any]:
    """msgspec structs with vLLM's field order (imported late: msgspec is an optional dependency).
    ``event_encoding`` "map": each event a map tagged by its class name under "type" (current vLLM, and
    what vllm-router's kv_aware policy decodes); "array": a positional array led by the tag (vLLM's
    original layout, which its example subscriber of that time decodes). The batch is an array either way."""
    try:
        import msgspec
    except ImportError:  # pragma: no cover - the extra is in the test install
        raise ValueError("kv_events_config with publisher 'zmq' needs pyzmq and msgspec: "
                         "pip install pyzmq msgspec") from None

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEventWire(msgspec.Struct, array_like=event_encoding == "array", omit_defaults=True, gc=False,
                           tag=True):
        pass

    class BlockStoredWire(KVCacheEventWire, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemovedWire(KVCacheEventWire, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksClearedWire(KVCacheEventWire, tag="AllBlocksCleared"):
        pass

    return {"batch": EventBatch, "stored": BlockStoredWire, "removed": BlockRemovedWire,
            "cleared": AllBlocksClearedWire, "encoder": msgspec.msgpack.Encoder()}


class ZmqEventPublisher:
    """PUB socket plus an optional ROUTER replay socket with a buffer of the last ``buffer_steps``
    batches; both live on one daemon thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        try:
            import zmq
        except ImportError:  # pragma: no cover - the extra is in the test install
            raise ValueError("kv_events_config with publisher 'zmq' needs pyzmq and msgspec: "
                             "pip install pyzmq msgspec") from None
        self._zmq = zmq
        self._wire = _wire_types(config.event_encoding)
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0  # batches sent
        self.num_dropped = 0  # batches dropped because the queue was full
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the KV events publisher did not start within {START_TIMEOUT_S:g} s")
        if self._start_error is not None:
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r} (replay "
                             f"{config.replay_endpoint!r}): {self._start_error}") from self._start_error
        logger.info("publishing KV cache events on %s%s (topic %r)", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "", config.topic)

    # ---------------------------------------------------------------- the engine's side
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch; never blocks (a full queue drops it, since a router copes with a gap better
        than the engine with a stall)."""
        if not events or self._stop.is_set():
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events queue full (max_queue_size=%d): %d batches dropped so far",
                               self.config.max_queue_size, self.num_dropped)

    def shutdown(self) -> None:
        """Send what is queued, then close the sockets (bounded by SHUTDOWN_TIMEOUT_S)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(SHUTDOWN_TIMEOUT_S)

    # ---------------------------------------------------------------- the publisher thread
    def _open(self) -> tuple[Any, Any]:
        zmq, cfg = self._zmq, self.config
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(cfg.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            endpoint = cfg.endpoint
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
            if cfg.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(cfg.replay_endpoint)
        except Exception:
            pub.close()
            if replay is not None:
                replay.close()
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except Exception as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        topic = self.config.topic.encode()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                if item is None:
                    break
                try:
                    payload = self._encode(*item)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                except Exception:  # a bad batch must not end the thread: log it and go on
                    logger.exception("KV events: failed to publish batch %d", seq)
                    continue
                self._buffer.append((seq, payload))
                self.num_published += 1
                seq += 1
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frames (expected 3)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_SEQ, b""))

    def _encode(self, ts: float, events: list[KVCacheEvent]) -> bytes:
        w = self._wire
        out = []
        for e in events:
            if isinstance(e, BlockStored):
                out.append(w["stored"](e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None,
                                       e.medium, None))
            elif isinstance(e, BlockRemoved):
                out.append(w["removed"](e.block_hashes, e.medium))
            elif isinstance(e, AllBlocksCleared):
                out.append(w["cleared"]())
        rank = self.data_parallel_rank or None  # rank 0 is the default: omitted, as vLLM's single engine
        return w["encoder"].encode(w["batch"](ts, out, rank))
