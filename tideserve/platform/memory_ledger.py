"""Engines that share one memory limit tell each other what they are about to make resident.

Why: two servers in one memory cgroup (or on one host without a limit, or on one GPU) read the same free
memory. Deciding alone, both take the same headroom at the same moment, and on a host a page touched
past the limit cannot fail gracefully: it summons the OOM killer. Memory a process has decided to take
but not yet made resident (a pool growth being committed, the part of its activation peak its allocator
has handed back for now) is invisible to a neighbour's reading, too.

So every engine publishes that figure, its claim, in a small file shared by every process under the same
limit, and decides each growth while holding the file's lock: it reads the free memory, subtracts what
the others claim, and publishes its own larger claim before it commits a page. The claim shrinks again
once the pages are resident (the limit's own usage shows them from then on). A claim counted twice for a
moment (committed and still claimed) only makes a neighbour more careful.

The file lives in /dev/shm (memory, gone at reboot; else the temporary directory), named by what bounds
the memory: the cgroup directory whose limit binds, the host, or a GPU. Each engine has an entry of its
own (several may share a process). An entry is dropped when its process has exited (a pid is checked with
its start time, so a reused pid does not inherit a claim), when its engine closes it or is collected, and
when it was not renewed for ``CLAIM_TTL_S`` (an engine renews its claim while it runs). A process that
cannot use the file runs on its safety margin alone, after one warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# A claim that rose by less than this is not written again (each write is a locked file rewrite).
CLAIM_WRITE_STEP_BYTES = 4 * 2**20
# An entry not renewed for this long is ignored: its engine is gone without closing it.
CLAIM_TTL_S = 30.0
# An engine renews its entry at least this often while its claim is not zero.
CLAIM_RENEW_S = 10.0
_engine_ids = itertools.count()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _default_directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class MemoryLedger:
    """The claims of every engine under one memory limit (see the module docstring).

    Thread-safe; ``exclusive()`` holds the file's lock (and this process's) so that reading the others'
    claims, deciding, and publishing the decision's claim happen as one step.
    """

    def __init__(self, scope: str, directory: Path | None = None) -> None:
        """``scope`` names what bounds the memory (a cgroup directory, "host", a GPU's id): engines with the
        same scope share one ledger."""
        self.scope = scope
        digest = hashlib.sha256(scope.encode()).hexdigest()[:16]
        self.path = (directory or _default_directory()) / f"tideserve-memory-{digest}.json"
        pid = os.getpid()
        self._key = f"{pid}:{next(_engine_ids)}"
        self._start = _start_time(pid) or ""
        self._lock = threading.RLock()
        self._fds: list[int] = []  # the open file, shared with the finalizer so it closes it
        self._depth = 0
        self._claim = 0
        self._written: int | None = None
        self._written_at = 0.0
        self._broken = False
        self._finalizer = weakref.finalize(self, _withdraw, self.path, self._key, self._fds)

    # ----------------------------------------------------------------- the file
    @property
    def _fd(self) -> int | None:
        return self._fds[0] if self._fds else None

    def _open(self) -> int | None:
        if not self._fds and not self._broken:
            try:
                self._fds.append(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666))
            except OSError as exc:
                self._broken = True
                logger.warning("memory ledger %s cannot be opened (%s): engines sharing this memory limit will "
                               "not see each other's claims; the safety margin alone guards it", self.path, exc)
        return self._fd

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the ledger: no other engine reads or writes claims until the block ends."""
        with self._lock:
            fd = self._open()
            locked = False
            if fd is not None and self._depth == 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    locked = True
                except OSError:
                    pass
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def _read(self) -> dict[str, list]:
        fd = self._fd
        if fd is None:
            return {}
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            text = os.read(fd, 1 << 20).decode() or "{}"
            entries = json.loads(text)
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return {}  # a torn or foreign file: start it over

    def _write(self, entries: dict[str, list]) -> None:
        fd = self._fd
        if fd is None:
            return
        data = json.dumps(entries).encode()
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        except OSError:
            pass

    def _live(self, entries: dict[str, list]) -> dict[str, list]:
        """The entries whose engine still runs: its process has the same start time, and it renewed the
        entry within ``CLAIM_TTL_S``."""
        return _live(entries, self._key)

    # ----------------------------------------------------------------- claims
    def others(self) -> int:
        """Bytes the other engines under this limit have claimed and not yet made resident."""
        with self.exclusive():
            return sum(entry[0] for key, entry in self._live(self._read()).items() if key != self._key)

    @property
    def claim(self) -> int:
        """This engine's claim as last published."""
        return self._claim

    def set_claim(self, num_bytes: int) -> None:
        """Publish this engine's claim: bytes it may still make resident that the limit's usage does not
        show. A rise under ``CLAIM_WRITE_STEP_BYTES`` is not written (every write is a locked rewrite of
        the file) unless the entry is due for renewal; any fall is written at once."""
        num_bytes = max(0, int(num_bytes))
        self._claim = num_bytes
        now = time.time()
        if (self._written is not None and num_bytes >= self._written
                and num_bytes - self._written < CLAIM_WRITE_STEP_BYTES
                and (num_bytes == 0 or now - self._written_at < CLAIM_RENEW_S)):
            return
        with self.exclusive():
            entries = self._live(self._read())
            entries[self._key] = [num_bytes, self._start, now]
            self._write(entries)
            self._written, self._written_at = num_bytes, now

    def close(self) -> None:
        """Withdraw this engine's entry (its memory is either resident and counted, or gone); the ledger
        is not used again."""
        with self._lock:
            self._broken = True
            self._finalizer()


def _live(entries: dict[str, list], own_key: str) -> dict[str, list]:
    now = time.time()
    live = {}
    for key, entry in entries.items():
        try:
            claim, start, renewed = int(entry[0]), str(entry[1]), float(entry[2])
            pid = int(key.partition(":")[0])
        except (TypeError, ValueError, IndexError):
            continue
        if key == own_key or (now - renewed < CLAIM_TTL_S and _start_time(pid) == start):
            live[key] = [claim, start, renewed]
    return live


def _withdraw(path: Path, key: str, fds: list[int]) -> None:
    """Drop ``key``'s entry and close the ledger's file (``close``, or an engine collected without it)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            entries = json.loads(os.read(fd, 1 << 20).decode() or "{}")
        except (OSError, ValueError, UnicodeDecodeError):
            return
        if isinstance(entries, dict) and entries.pop(key, None) is not None:
            data = json.dumps(entries).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, data)
            os.ftruncate(fd, len(data))
    except OSError:
        pass
    finally:
        os.close(fd)
