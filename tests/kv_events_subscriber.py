"""A KV-events subscriber for tests, written from vLLM's wire format (not from tideserve's publisher):
msgspec array-like tagged structs over ZMQ ``[topic, seq, payload]``, and the ROUTER replay protocol."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _event_types(array_like: bool) -> tuple[type, type, type]:
    """vLLM's event structs: tagged maps ("type": class name) today, positional arrays originally."""

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


BlockStored, BlockRemoved, AllBlocksCleared = _event_types(array_like=False)
_ARRAY_TYPES = _event_types(array_like=True)


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayKVEventBatch(EventBatch):
    events: list[_ARRAY_TYPES[0] | _ARRAY_TYPES[1] | _ARRAY_TYPES[2]]


DECODERS = {"map": msgspec.msgpack.Decoder(KVEventBatch), "array": msgspec.msgpack.Decoder(ArrayKVEventBatch)}
DECODER = DECODERS["map"]


def kind(event: Any) -> str:
    """The event's type name, whichever layout it was decoded from."""
    return type(event).__name__


def replay_view(batches: list[KVEventBatch]) -> set[int]:
    """The cached hashes a router holds after applying ``batches`` in order."""
    view: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if kind(event) == "BlockStored":
                view.update(event.block_hashes)
            elif kind(event) == "BlockRemoved":
                view.difference_update(event.block_hashes)
            else:
                view.clear()
    return view


class Subscriber:
    """``with Subscriber("tcp://127.0.0.1:5557") as sub:`` a SUB socket on every topic."""

    def __init__(self, endpoint: str, topic: str = "", encoding: str = "map") -> None:
        self.decoder = DECODERS[encoding]
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.batches: list[tuple[bytes, int, KVEventBatch]] = []  # (topic, seq, batch) as received

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def poll(self, timeout_s: float) -> None:
        """Receive what arrives within ``timeout_s`` (or until nothing more is waiting)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.batches.append((topic, int.from_bytes(seq, "big"), self.decoder.decode(payload)))

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            assert time.monotonic() < deadline, f"no KV event batch {what} within {timeout_s:g} s"
            self.poll(0.2)

    def events(self) -> list[Any]:
        return [e for _, _, b in self.batches for e in b.events]


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """Ask the publisher's replay socket for every buffered batch from ``start_seq`` on."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), f"no replay answer within {timeout_s:g} s"
            _, seq, payload = sock.recv_multipart()
            seq_no = int.from_bytes(seq, "big", signed=True)
            if seq_no == END_SEQ:
                return out
            out.append((seq_no, DECODER.decode(payload)))
    finally:
        sock.close()
