"""What the host's memory probe is made of, read from /proc and the cgroup filesystem without torch: the
headroom of the process's own memory cgroup when a limit is set on it or on an ancestor (containers, job
slots), else the kernel's MemAvailable, and the process's resident set and its high-water mark. The CPU
platform (cpu.py) answers the ``MemoryProbe`` questions (tideserve/core/kv_cache/memory.py) with them.

The cgroup is the process's own (found through /proc/self/cgroup and /proc/self/mountinfo), never the
root of the hierarchy: two servers placed together in one limited cgroup must each see the shared
ceiling, and read it again at every call, so that one engine growing shrinks what the other may take.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

GiB = 1 << 30
# cgroup v1 reports "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX * page size).
_UNLIMITED = 1 << 60


def _read_text(path: str | os.PathLike[str]) -> str | None:
    """A file's text, or None when it cannot be read (a probe must never fail the engine)."""
    try:
        return Path(path).read_text()
    except (OSError, ValueError):
        return None


def _read_int(path: str | os.PathLike[str]) -> int | None:
    """An integer file such as memory.max; None when absent, unreadable, "max" or not a number."""
    text = (_read_text(path) or "").strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _kib_field(path: str | os.PathLike[str], key: str) -> int | None:
    """A "Key:   123 kB" line of a /proc file, in bytes (None when absent or unreadable)."""
    try:
        for line in (_read_text(path) or "").splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (ValueError, IndexError):
        return None
    return None


def _stat_field(path: str | os.PathLike[str], key: str) -> int | None:
    """A "key value" line of a cgroup memory.stat file (None when absent or unreadable)."""
    for line in (_read_text(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def process_rss_bytes() -> int:
    return _kib_field("/proc/self/status", "VmRSS") or 0


@dataclass(frozen=True)
class MemoryCgroup:
    """Where this process's memory cgroup lives: its directory and the mount of its hierarchy."""

    version: int
    """1 (the v1 memory controller) or 2 (the unified hierarchy)."""
    directory: Path
    """The process's own cgroup directory, or the mount point when that directory is not visible."""
    mount_point: Path

    def levels(self) -> list[Path]:
        """The directory and each ancestor up to the mount point: a limit on any of them binds the process."""
        if self.directory == self.mount_point or self.mount_point not in self.directory.parents:
            return [self.directory]
        levels = [self.directory]
        for parent in self.directory.parents:
            levels.append(parent)
            if parent == self.mount_point:
                break
        return levels


@dataclass(frozen=True)
class CgroupLimit:
    """One reading of the binding memory ceiling of a cgroup."""

    limit_bytes: int
    """The smallest limit over the cgroup and its ancestors."""
    headroom_bytes: int
    """The smallest of limit - working set over the limited levels: what may still be taken now."""
    limit_directory: Path
    """The level that holds the smallest limit (for logs: a parent's limit is easy to overlook)."""


# Per version: limit file, usage file, memory.stat key of the reclaimable page cache.
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_V2_FILES = ("memory.max", "memory.current", "inactive_file")


@dataclass(frozen=True)
class _Mount:
    """The fields of one /proc/self/mountinfo line that locating a cgroup needs."""

    root: str
    mount_point: str
    fstype: str
    super_options: tuple[str, ...]


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _parse_mountinfo(text: str) -> list[_Mount]:
    """Mount entries; the optional fields before "-" vary in number, so the separator is searched for."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 2:
            continue
        super_options = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), fields[sep + 1], tuple(super_options)))
    return mounts


def _parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """The v1 memory controller's cgroup path and the v2 (unified) path, each None when absent."""
    v1_path = v2_path = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    return v1_path, v2_path


def _relative_to_root(path: str, root: str) -> str | None:
    """The cgroup path below a mount's root (mountinfo field 4); None when the mount does not contain it.

    In a container or cgroup namespace the mount may show only a subtree: its root is then "/" (namespace)
    or a prefix of the path (bind-mounted subtree), and the process's directory is the rest of the path.
    """
    root, path = root.rstrip("/"), path.rstrip("/")
    if path == root:
        return ""
    if path.startswith(root + "/"):
        return path[len(root) + 1:]
    return None


def _locate(path: str, mounts: list[_Mount]) -> tuple[Path, Path] | None:
    """(cgroup directory, mount point) for a cgroup path over candidate mounts of its hierarchy.

    A mount holding the directory wins; otherwise the first mount's point stands in for it (the limit a
    container sees is usually set on the cgroup mounted there).
    """
    if not mounts:
        return None
    for mount in mounts:
        relative = _relative_to_root(path, mount.root)
        if relative is None:
            continue
        directory = Path(mount.mount_point, relative) if relative else Path(mount.mount_point)
        if os.path.isdir(directory):
            return directory, Path(mount.mount_point)
    return Path(mounts[0].mount_point), Path(mounts[0].mount_point)


class CgroupMemory:
    """The memory ceiling of this process's own cgroup (v1 or v2), read without torch.

    Where the cgroup lives is resolved once (it changes only if the process is moved); the limit, usage
    and page-cache figures are read again on every call, since engines sharing one limit must see each
    other's growth. Anything unreadable means "no cgroup limit": the probe never raises.
    """

    def __init__(self, proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
                 mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo",
                 meminfo: str | os.PathLike[str] = "/proc/meminfo") -> None:
        self.proc_cgroup = Path(proc_cgroup)
        self.mountinfo = Path(mountinfo)
        self.meminfo = Path(meminfo)

    @cached_property
    def cgroup(self) -> MemoryCgroup | None:
        """The process's memory cgroup, or None when there is none to be found (resolved once)."""
        try:
            return self._resolve()
        except (OSError, ValueError):
            return None

    def _resolve(self) -> MemoryCgroup | None:
        """v1's memory controller when it is mounted, else v2 when its directory has memory.max."""
        v1_path, v2_path = _parse_proc_cgroup(_read_text(self.proc_cgroup) or "")
        mounts = _parse_mountinfo(_read_text(self.mountinfo) or "")
        if v1_path is not None:
            v1_mounts = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]
            found = _locate(v1_path, v1_mounts)
            if found is not None:
                return MemoryCgroup(1, *found)
        if v2_path is not None:
            found = _locate(v2_path, [m for m in mounts if m.fstype == "cgroup2"])
            # On hybrid hosts the unified mount carries no memory controller, hence no memory.max.
            if found is not None and os.path.isfile(found[0] / "memory.max"):
                return MemoryCgroup(2, *found)
        return None

    def read(self) -> CgroupLimit | None:
        """The binding limit and headroom now, over the cgroup and its ancestors; None when unlimited."""
        cgroup = self.cgroup
        if cgroup is None:
            return None
        limit_file, usage_file, inactive_key = _V1_FILES if cgroup.version == 1 else _V2_FILES
        readings = []
        for level in cgroup.levels():
            limit = _read_int(level / limit_file)
            if limit is not None and limit < _UNLIMITED:
                readings.append((limit, self._level_headroom(level, limit, usage_file, inactive_key), level))
        if not readings:
            return None
        limit, _headroom, level = min(readings, key=lambda reading: reading[0])
        return CgroupLimit(limit, min(reading[1] for reading in readings), level)

    @staticmethod
    def _level_headroom(level: Path, limit: int, usage_file: str, inactive_key: str) -> int:
        """limit - working set, where the working set leaves out inactive page cache (as kubelet does):
        the kernel reclaims that cache before it would fail an allocation."""
        usage = _read_int(level / usage_file) or 0
        inactive = _stat_field(level / "memory.stat", inactive_key) or 0
        return max(0, limit - max(0, usage - inactive))

    def limit_bytes(self) -> int | None:
        reading = self.read()
        return reading.limit_bytes if reading is not None else None

    def headroom_bytes(self) -> int | None:
        reading = self.read()
        return reading.headroom_bytes if reading is not None else None

    def available_bytes(self) -> int:
        """min(MemAvailable, cgroup headroom): the host may be short of memory before the cgroup is."""
        return _smallest(_kib_field(self.meminfo, "MemAvailable"), self.headroom_bytes())

    def total_bytes(self) -> int:
        """min(MemTotal, cgroup limit)."""
        return _smallest(_kib_field(self.meminfo, "MemTotal"), self.limit_bytes())

    def describe(self) -> str:
        """Which cgroup binds this process, for the start-up log."""
        cgroup = self.cgroup
        if cgroup is None:
            return "no memory cgroup limit"
        where = f"cgroup v{cgroup.version} {cgroup.directory}"
        reading = self.read()
        if reading is None:
            return f"no memory cgroup limit ({where})"
        text = f"{where}, limit {reading.limit_bytes / GiB:.2f} GiB"
        if reading.limit_directory != cgroup.directory:
            text += f" (set on {reading.limit_directory})"
        return text


def _smallest(*values: int | None) -> int:
    """The smallest of the figures that could be read, 0 when none could."""
    known = [v for v in values if v is not None]
    return min(known) if known else 0


@lru_cache(maxsize=1)
def host_cgroup_memory() -> CgroupMemory:
    """The process-wide reader, so the mount resolution is done once however many probes are made."""
    return CgroupMemory()


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM) so a profiling run can read its own peak."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _kib_field("/proc/self/status", "VmHWM") or 0

