"""One rank's disk tier: a directory of checksummed block files, written atomically off the engine thread.

Layout: ``<kv_cache_dir>/<fingerprint>/rank<r>/<key[:2]>/<key>.kv``, one file per full prefix block, named by its
tier key (core/kv_cache/tiers.py: a stable hash chain over the prefix, rooted in the block size and the
cache salt). The fingerprint names everything else that changes a block's bytes: the model file (path,
size, mtime), dtype, KV dtype, quantization, the architecture's configuration, the tokenizer and the
tensor-parallel size; each rank keeps its own shard's files in ``rank<r>``. A ``fingerprint.json``
beside the files says what it stands for; directories of other fingerprints are left alone (another
model, another dtype: one log line says they are ignored).

A file is a fixed header (magic, format version, fingerprint digest, key, payload length,
CRC-32 of the payload) and the payload: the block's K and V of every layer, as the pool holds them.
Why so careful: storage fails in ways memory does not. A file that is truncated, corrupted, written for
another fingerprint or under another key fails its checks on load; it is skipped (the prefix is
recomputed: the same output) and removed. Files are written to a temporary name in the same directory
and renamed into place, so a reader never sees a partly written block, and a server killed mid-write
leaves only a temporary file (removed by the next scan once it is a minute old).

Writes run on a thread of their own (file I/O and hashing release the GIL): ``save`` keeps the bytes in
``_pending`` until the file is in place, and a load finds them there meanwhile. A write that fails (a
full disk, a read-only one) turns the tier off: ``error`` says why, the engine logs it once and stops
using the tier; no request fails for it.

Several servers may share a directory: names are unique per process and renames are atomic, so they
never corrupt each other, and a server with the same fingerprint serves the others' blocks that it found
when it started. Each bounds only what it indexed, so together they may hold up to the sum of their sizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"TSKV"
VERSION = 1
_HEADER = struct.Struct("<4sH16s16sQI")  # magic, version, fingerprint, key, payload bytes, CRC-32 of the payload
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
STALE_TMP_S = 60.0  # a temporary file this old belongs to a write that will never finish
# Files of one load are read and checked by this many threads at once: a read (preadv) and a CRC-32 each
# release the GIL, and on two cores two threads halve a restart's load.
READ_THREADS = 2


def checksum(payload: bytes | memoryview) -> int:
    """CRC-32 of a payload: it catches every burst of flipped bits up to 32 long and almost any other damage,
    at several GB/s (a cryptographic hash here would cost a restart's load more than the read itself); the
    header's key, fingerprint and length catch a file that is whole but not this block's."""
    return zlib.crc32(payload)


def fingerprint_digest(fingerprint: dict[str, str]) -> bytes:
    """A fingerprint's 16-byte digest (its directory's name in hex)."""
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class TierFile:
    """A block file found by a scan: its key, bytes on disk and last use (mtime)."""

    key: bytes
    num_bytes: int
    mtime: float


@dataclass
class TierLoadResult:
    """What a load found: how many leading blocks passed every check (nothing past the first that did
    not is read), the keys whose files were bad (removed), the bytes read, and (``DiskTier.load``) the
    payloads themselves."""

    num_loaded: int
    bad_keys: list[bytes]
    bytes_read: int
    payloads: list[memoryview] = field(default_factory=list)


class DiskTier:
    """This rank's files of one fingerprint under ``root``. ``open`` creates the directory and proves it
    writable; a failure there raises OSError (the engine leaves the tier off)."""

    def __init__(self, root: str | os.PathLike, fingerprint: dict[str, str], rank: int = 0) -> None:
        self.fingerprint = fingerprint
        self.root = Path(root)
        self.home = self.root / fingerprint_digest(fingerprint).hex()  # this fingerprint's directory
        self.dir = self.home / f"rank{rank}"
        self.digest = fingerprint_digest({**fingerprint, "tp_rank": str(rank)})  # what each file's header carries
        self.error: str | None = None  # why writing stopped (the tier is off), once a write failed
        # key -> (header, payload) of a file not yet renamed into place
        self._pending: dict[bytes, tuple[bytes, memoryview]] = {}
        self._lock = threading.Lock()  # orders a rename against a removal of the same key
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._tmp_seq = 0
        self._loads: ThreadPoolExecutor | None = None  # one load after the other (``start_load``)
        self._files: ThreadPoolExecutor | None = None  # the files of one load, READ_THREADS at a time

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.home / "fingerprint.json"
        if not meta.exists():
            self._write_atomic(meta, json.dumps(self.fingerprint, sort_keys=True, indent=1).encode())
        probe = self.dir / f".probe.{os.getpid()}"
        probe.write_bytes(b"ok")  # a read-only directory fails here, before any request relies on it
        probe.unlink()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-load")
        self._files = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-disk-read")

    def other_fingerprints(self) -> list[str]:
        """Fingerprint directories under the root other than this one (another model, dtype, TP size)."""
        try:
            return sorted(p.name for p in self.root.iterdir()
                          if p.is_dir() and p.name != self.home.name and (p / "fingerprint.json").exists())
        except OSError:
            return []

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    # ----------------------------------------------------------------- scan (a restart)
    def scan(self) -> list[TierFile]:
        """Every block file of this fingerprint, least recently used first; stale temporary files go."""
        found = []
        now = time.time()
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    stat = path.stat()
                    if path.name.endswith(SUFFIX):
                        key = bytes.fromhex(path.name[:-len(SUFFIX)])
                        found.append(TierFile(key, stat.st_size, stat.st_mtime))
                    elif path.name.endswith(".tmp") and now - stat.st_mtime > STALE_TMP_S:
                        path.unlink()
                except (OSError, ValueError):
                    continue
        found.sort(key=lambda f: f.mtime)
        return found

    # ----------------------------------------------------------------- writes
    def file_bytes(self, payload_bytes: int) -> int:
        return HEADER_BYTES + payload_bytes

    def save(self, key: bytes, payload: bytes | memoryview) -> None:
        """Write a block's payload under ``key`` (on the writer thread); a load finds it at once."""
        if self.error is not None or self._writer is None:
            return
        payload = memoryview(payload).cast("B")
        with self._lock:
            self._pending[key] = (_HEADER.pack(MAGIC, VERSION, self.digest, key, len(payload), 0), payload)
        self._queue.put(key)

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                data = self._pending.get(key)
            if data is None or self.error is not None:  # removed meanwhile, or the tier is off
                continue
            path = self.path_of(key)
            header, payload = data
            try:
                path.parent.mkdir(exist_ok=True)
                tmp = self._tmp_path(path)
                with open(tmp, "wb") as f:  # the checksum here, off the engine thread (zlib releases the GIL)
                    f.write(header[:-4] + checksum(payload).to_bytes(4, "little"))
                    f.write(payload)
                with self._lock:
                    if self._pending.get(key) is data:
                        os.replace(tmp, path)
                        del self._pending[key]
                    else:
                        tmp.unlink()
            except OSError as exc:
                self.error = f"writing {path} failed: {exc}"
                with self._lock:
                    self._pending.clear()
                try:
                    tmp.unlink()
                except (OSError, UnboundLocalError):
                    pass

    def _tmp_path(self, path: Path) -> Path:
        self._tmp_seq += 1
        return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{self._tmp_seq}.tmp")

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = self._tmp_path(path)
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def flush(self) -> None:
        """Wait until every write queued so far is on disk (or failed)."""
        if self._writer is None:
            return
        self._queue.put(None)
        self._writer.join()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Finish the queued writes and loads and stop the tier's threads."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        for pool in (self._loads, self._files):
            if pool is not None:
                pool.shutdown(wait=True)
        self._loads = self._files = None

    # ----------------------------------------------------------------- reads and removals
    def load(self, keys: list[bytes], payload_bytes: int) -> TierLoadResult:
        """``load_into`` a buffer of its own; the payloads are views of it, in order."""
        buffer = memoryview(bytearray(len(keys) * payload_bytes))
        result = self.load_into(keys, payload_bytes, buffer)
        result.payloads = [buffer[i * payload_bytes:(i + 1) * payload_bytes] for i in range(result.num_loaded)]
        return result

    def start_load(self, keys: list[bytes], payload_bytes: int, out: memoryview) -> Future[TierLoadResult]:
        """``load_into`` on the tier's own thread (loads run one after the other, in the order started):
        the caller goes on meanwhile, and ``out`` must stay alive and untouched until the future is done."""
        if self._loads is None:
            raise RuntimeError("the disk tier is closed")
        return self._loads.submit(self.load_into, keys, payload_bytes, out)

    def load_into(self, keys: list[bytes], payload_bytes: int, out: memoryview) -> TierLoadResult:
        """Read the payloads of ``keys`` into consecutive ``payload_bytes`` rows of ``out``, in order, up to
        the first missing or bad one (a bad file, one whose size, header or checksum is wrong, is removed);
        each file read is marked recently used.

        One ``preadv`` per file reads its header and payload straight into place (no intermediate copy: a
        restart's load is memory bandwidth as much as storage), and the checksum is computed on the row;
        ``READ_THREADS`` threads share the files. Files past the first miss may be read too (they are
        checked, and a bad one removed), but only the leading good ones count."""
        out = memoryview(out).cast("B")
        rows = [out[i * payload_bytes:(i + 1) * payload_bytes] for i in range(len(keys))]
        files = self._files
        if files is None or len(keys) < 2 * READ_THREADS:
            outcomes = [self._read_one(key, row) for key, row in zip(keys, rows)]
        else:
            step = -(-len(keys) // READ_THREADS)
            parts = [files.submit(self._read_some, keys[i:i + step], rows[i:i + step])
                     for i in range(step, len(keys), step)]
            outcomes = self._read_some(keys[:step], rows[:step])
            for part in parts:
                outcomes += part.result()
        result = TierLoadResult(0, [], 0)
        counting = True
        for key, (status, num_read) in zip(keys, outcomes):
            result.bytes_read += num_read
            if status == "bad":
                result.bad_keys.append(key)
            counting = counting and status == "ok"
            result.num_loaded += counting
        return result

    def _read_some(self, keys: list[bytes], rows: list[memoryview]) -> list[tuple[str, int]]:
        return [self._read_one(key, row) for key, row in zip(keys, rows)]

    def _read_one(self, key: bytes, row: memoryview) -> tuple[str, int]:
        """Read one block into ``row``: ("ok" | "missing" | "bad", bytes read); a bad file is removed."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:  # not on disk yet: the bytes are right here
            row[:] = pending[1]
            return "ok", 0
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return "missing", 0  # gone (another server evicted it) or unreadable: a miss
        header = bytearray(HEADER_BYTES)
        file_bytes = HEADER_BYTES + len(row)
        try:
            size = os.fstat(fd).st_size
            num_read = os.preadv(fd, [header, row], 0) if size == file_bytes else size
            try:
                os.utime(fd)
            except OSError:
                pass
        except OSError:
            return "missing", 0
        finally:
            os.close(fd)
        if num_read != file_bytes or not self._check(key, header, row, len(row)):
            logger.warning("KV disk tier: %s failed its checks (truncated, corrupted or foreign): removed, its "
                           "prefix is recomputed", path)
            self.remove([key])
            return "bad", num_read
        return "ok", num_read

    def _check(self, key: bytes, header: bytes | bytearray, payload: memoryview, payload_bytes: int) -> bool:
        magic, version, digest, file_key, length, check = _HEADER.unpack_from(header)
        return (magic == MAGIC and version == VERSION and digest == self.digest and file_key == key
                and length == payload_bytes and checksum(payload) == check)

    def remove(self, keys: list[bytes]) -> None:
        """Drop these blocks (evicted by the index, or bad): pending writes are cancelled, files unlinked."""
        for key in keys:
            with self._lock:
                self._pending.pop(key, None)
                try:
                    self.path_of(key).unlink()
                except OSError:
                    pass
