"""The host memory probe finds the process's own memory cgroup, not the root's, and re-reads its ceiling.

Fake /proc/self/cgroup, mountinfo, meminfo and cgroup trees under tmp_path cover the layouts met in
practice (v1 nested job slots, v2, hybrid hosts, namespaced container mounts); two tests check the real
machine, one of them inside a freshly made v1 child cgroup with its own limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tideserve.platform.cpu import CpuPlatform
from tideserve.platform.host_memory import (
    CgroupMemory,
    MemoryCgroup,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_rss,
)

GiB = 1 << 30
MiB = 1 << 20
V1_UNLIMITED = 9223372036854771712  # what a v1 memory.limit_in_bytes reads without a limit
MEM_TOTAL = 64 * GiB
MEM_AVAILABLE = 48 * GiB
REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeHost:
    """A fake /proc and /sys under tmp_path, assembled line by line by each test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc_lines: list[str] = []
        self.mount_lines = ["23 1 0:21 / /proc rw,nosuid - proc proc rw",
                            f"31 23 0:28 / {root}/sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755"]
        (root / "meminfo").write_text(f"MemTotal:       {MEM_TOTAL // 1024} kB\n"
                                      f"MemFree:        {MEM_AVAILABLE // 2048} kB\n"
                                      f"MemAvailable:   {MEM_AVAILABLE // 1024} kB\n")

    def sys_path(self, relative: str) -> Path:
        return self.root / "sys" / relative

    def mount(self, relative: str, fstype: str, super_options: str, root: str = "/") -> Path:
        """A mountinfo entry for a cgroup hierarchy mounted at sys/<relative>; the directory is created."""
        point = self.sys_path(relative)
        point.mkdir(parents=True, exist_ok=True)
        mount_id = 40 + len(self.mount_lines)
        self.mount_lines.append(f"{mount_id} 31 0:{mount_id} {root} {point} rw,nosuid,nodev,noexec,relatime "
                                f"shared:{mount_id} - {fstype} {fstype} {super_options}")
        return point

    def v1_level(self, directory: Path, limit: int = V1_UNLIMITED, usage: int = 0, inactive: int = 0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (directory / "memory.usage_in_bytes").write_text(f"{usage}\n")
        # The hierarchical total is the one to use; the local inactive_file is a decoy.
        (directory / "memory.stat").write_text(f"cache 0\ninactive_file {inactive // 2}\nactive_file 7\n"
                                               f"total_active_file 7\ntotal_inactive_file {inactive}\n")

    def v2_level(self, directory: Path, limit: int | str = "max", usage: int = 0, inactive: int = 0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "memory.max").write_text(f"{limit}\n")
        (directory / "memory.current").write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"anon 0\nfile 0\ninactive_anon 5\nactive_file 9\n"
                                               f"inactive_file {inactive}\n")

    def probe(self) -> CgroupMemory:
        (self.root / "cgroup").write_text("".join(line + "\n" for line in self.proc_lines))
        (self.root / "mountinfo").write_text("".join(line + "\n" for line in self.mount_lines))
        return CgroupMemory(self.root / "cgroup", self.root / "mountinfo", self.root / "meminfo")


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path)


def v1_host(host: FakeHost, cgroup_path: str) -> Path:
    """A v1 host (hybrid: the unified mount has no memory controller) with the process in cgroup_path."""
    host.proc_lines = ["9:name=systemd:/", "4:memory:" + cgroup_path, "2:cpu,cpuacct:/", "0::/"]
    host.mount("fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
    memory = host.mount("fs/cgroup/memory", "cgroup", "rw,memory")
    host.mount("fs/cgroup/unified", "cgroup2", "rw,nsdelegate")
    host.v1_level(memory, usage=10 * GiB)
    return memory


def test_v1_nested_cgroup_parent_limit_binds(host: FakeHost) -> None:
    memory = v1_host(host, "/process_api/abc")
    host.v1_level(memory / "process_api", limit=4 * GiB, usage=3 * GiB, inactive=512 * MiB)
    host.v1_level(memory / "process_api/abc", usage=1 * GiB)
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory / "process_api/abc", memory)
    assert probe.limit_bytes() == 4 * GiB
    assert probe.headroom_bytes() == 4 * GiB - (3 * GiB - 512 * MiB)
    assert probe.total_bytes() == 4 * GiB
    assert probe.available_bytes() == 4 * GiB - (3 * GiB - 512 * MiB)
    assert probe.describe() == (f"cgroup v1 {memory / 'process_api/abc'}, limit 4.00 GiB "
                                f"(set on {memory / 'process_api'})")


def test_v1_child_limit_smaller_each_figure_is_the_minimum_over_levels(host: FakeHost) -> None:
    memory = v1_host(host, "/process_api/abc")
    host.v1_level(memory / "process_api", limit=4 * GiB, usage=3 * GiB)  # headroom 1 GiB
    host.v1_level(memory / "process_api/abc", limit=2 * GiB, usage=512 * MiB)  # headroom 1.5 GiB
    probe = host.probe()

    assert probe.limit_bytes() == 2 * GiB
    assert probe.headroom_bytes() == 1 * GiB
    assert probe.describe() == f"cgroup v1 {memory / 'process_api/abc'}, limit 2.00 GiB"


def test_v2_max_means_no_limit(host: FakeHost) -> None:
    host.proc_lines = ["0::/system.slice/engine.service"]
    unified = host.mount("fs/cgroup", "cgroup2", "rw,nsdelegate,memory_recursiveprot")
    host.v2_level(unified / "system.slice/engine.service", limit="max", usage=2 * GiB)
    host.v2_level(unified / "system.slice", limit="max")
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(2, unified / "system.slice/engine.service", unified)
    assert probe.read() is None
    assert probe.total_bytes() == MEM_TOTAL
    assert probe.available_bytes() == MEM_AVAILABLE
    assert probe.describe() == f"no memory cgroup limit (cgroup v2 {unified / 'system.slice/engine.service'})"


def test_v2_numeric_limit_subtracts_inactive_file(host: FakeHost) -> None:
    host.proc_lines = ["0::/job"]
    unified = host.mount("fs/cgroup", "cgroup2", "rw,nsdelegate")
    host.v2_level(unified / "job", limit=1 * GiB, usage=800 * MiB, inactive=300 * MiB)
    probe = host.probe()

    assert probe.limit_bytes() == 1 * GiB
    assert probe.headroom_bytes() == 1 * GiB - (800 * MiB - 300 * MiB)
    assert probe.total_bytes() == 1 * GiB
    assert probe.available_bytes() == 524 * MiB


def test_headroom_never_exceeds_host_memavailable(host: FakeHost) -> None:
    host.proc_lines = ["0::/job"]
    unified = host.mount("fs/cgroup", "cgroup2", "rw")
    host.v2_level(unified / "job", limit=100 * GiB, usage=1 * GiB)
    probe = host.probe()

    assert probe.headroom_bytes() == 99 * GiB
    assert probe.available_bytes() == MEM_AVAILABLE
    assert probe.total_bytes() == MEM_TOTAL


def test_hybrid_host_prefers_v1_memory_over_v2_without_memory_max(host: FakeHost) -> None:
    memory = v1_host(host, "/slot")
    host.v1_level(memory / "slot", limit=3 * GiB, usage=1 * GiB)
    host.proc_lines[-1] = "0::/slot"
    (host.sys_path("fs/cgroup/unified") / "slot").mkdir()  # unified dir exists, but has no memory.max
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory / "slot", memory)
    assert probe.limit_bytes() == 3 * GiB
    assert probe.headroom_bytes() == 2 * GiB
    assert probe.describe() == f"cgroup v1 {memory / 'slot'}, limit 3.00 GiB"


def test_v2_without_memory_max_is_no_memory_cgroup(host: FakeHost) -> None:
    host.proc_lines = ["1:name=systemd:/", "0::/"]
    host.mount("fs/cgroup/unified", "cgroup2", "rw")
    probe = host.probe()

    assert probe.cgroup is None
    assert probe.describe() == "no memory cgroup limit"
    assert probe.total_bytes() == MEM_TOTAL


def test_v1_named_but_not_mounted_falls_to_v2(host: FakeHost) -> None:
    host.proc_lines = ["4:memory:/slot", "0::/slot"]
    unified = host.mount("fs/cgroup", "cgroup2", "rw")
    host.v2_level(unified / "slot", limit=2 * GiB)
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(2, unified / "slot", unified)
    assert probe.limit_bytes() == 2 * GiB


@pytest.mark.parametrize("proc_path, mount_root, expected", [
    ("/", "/", ""),                                    # cgroup namespace: the mount is the namespace's root
    ("/inner", "/", "inner"),                          # namespace, process moved below its root
    ("/docker/abc", "/docker/abc", ""),                # container without a namespace: subtree bind-mounted
    ("/docker/abc/inner", "/docker/abc", "inner"),     # ... and a child below it
    ("/docker/abc/inner", "/docker/abc/", "inner"),    # trailing slash on the root
])
def test_namespaced_mount_maps_the_path_through_the_mount_root(host: FakeHost, proc_path: str, mount_root: str,
                                                               expected: str) -> None:
    host.proc_lines = ["5:memory:" + proc_path]
    memory = host.mount("fs/cgroup/memory", "cgroup", "rw,memory", root=mount_root)
    host.v1_level(memory, limit=8 * GiB, usage=2 * GiB)
    if expected:
        host.v1_level(memory / expected, usage=1 * GiB)
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory / expected if expected else memory, memory)
    assert probe.limit_bytes() == 8 * GiB
    assert probe.headroom_bytes() == 6 * GiB


def test_path_outside_the_mount_root_falls_back_to_the_mount_point(host: FakeHost) -> None:
    host.proc_lines = ["5:memory:/elsewhere/abc"]
    memory = host.mount("fs/cgroup/memory", "cgroup", "rw,memory", root="/docker/abc")
    host.v1_level(memory, limit=1 * GiB)
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory, memory)
    assert probe.limit_bytes() == 1 * GiB


def test_missing_directory_falls_back_to_the_mount_point(host: FakeHost) -> None:
    memory = v1_host(host, "/process_api/gone")
    (memory / "memory.limit_in_bytes").write_text(f"{5 * GiB}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory, memory)
    assert probe.limit_bytes() == 5 * GiB
    assert probe.headroom_bytes() == 3 * GiB


def test_mountinfo_octal_escapes_in_the_mount_point(host: FakeHost) -> None:
    host.proc_lines = ["4:memory:/slot"]
    memory = host.mount("fs/cgroup/my memory", "cgroup", "rw,memory")
    host.mount_lines[-1] = host.mount_lines[-1].replace("my memory", "my\\040memory")
    host.v1_level(memory / "slot", limit=1 * GiB)
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory / "slot", memory)
    assert probe.limit_bytes() == 1 * GiB


def test_no_cgroup_at_all(host: FakeHost) -> None:
    probe = host.probe()  # empty /proc/self/cgroup, no cgroup mounts

    assert probe.cgroup is None
    assert probe.read() is None and probe.limit_bytes() is None and probe.headroom_bytes() is None
    assert probe.total_bytes() == MEM_TOTAL
    assert probe.available_bytes() == MEM_AVAILABLE
    assert probe.describe() == "no memory cgroup limit"


def test_unreadable_files_degrade_to_no_limit(tmp_path: Path) -> None:
    missing = CgroupMemory(tmp_path / "no-cgroup", tmp_path / "no-mountinfo", tmp_path / "no-meminfo")
    assert missing.cgroup is None
    assert missing.total_bytes() == 0 and missing.available_bytes() == 0
    assert missing.describe() == "no memory cgroup limit"

    (tmp_path / "cgroup").write_text("garbage\n4:memory\n::::\n")
    (tmp_path / "mountinfo").write_text("short line\n1 2 3 - \n")
    (tmp_path / "meminfo").write_text("MemTotal: lots kB\n")
    garbage = CgroupMemory(tmp_path / "cgroup", tmp_path / "mountinfo", tmp_path / "meminfo")
    assert garbage.cgroup is None
    assert garbage.total_bytes() == 0


def test_unreadable_level_files_mean_no_limit_at_that_level(host: FakeHost) -> None:
    memory = v1_host(host, "/slot")
    (memory / "slot").mkdir()
    (memory / "slot" / "memory.limit_in_bytes").write_text("not a number\n")
    probe = host.probe()

    assert probe.cgroup == MemoryCgroup(1, memory / "slot", memory)
    assert probe.read() is None
    assert probe.total_bytes() == MEM_TOTAL


def test_limit_without_usage_file_gives_the_whole_limit_as_headroom(host: FakeHost) -> None:
    memory = v1_host(host, "/slot")
    (memory / "slot").mkdir()
    (memory / "slot" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    probe = host.probe()

    assert probe.headroom_bytes() == 2 * GiB


def test_usage_and_limit_are_read_again_on_every_call(host: FakeHost) -> None:
    memory = v1_host(host, "/process_api/abc")
    host.v1_level(memory / "process_api", limit=4 * GiB, usage=1 * GiB)
    host.v1_level(memory / "process_api/abc", usage=1 * GiB)
    probe = host.probe()
    assert probe.available_bytes() == 3 * GiB

    # A second engine in the same parent cgroup grows: this one must see the shared ceiling shrink.
    (memory / "process_api" / "memory.usage_in_bytes").write_text(f"{3 * GiB + 512 * MiB}\n")
    assert probe.available_bytes() == 512 * MiB
    (memory / "process_api" / "memory.limit_in_bytes").write_text(f"{6 * GiB}\n")
    assert probe.available_bytes() == 2 * GiB + 512 * MiB
    assert probe.total_bytes() == 6 * GiB


def test_mount_resolution_is_cached(host: FakeHost) -> None:
    memory = v1_host(host, "/slot")
    host.v1_level(memory / "slot", limit=1 * GiB)
    probe = host.probe()
    assert probe.cgroup == MemoryCgroup(1, memory / "slot", memory)

    (host.root / "cgroup").write_text("0::/\n")
    (host.root / "mountinfo").write_text("")
    assert probe.cgroup == MemoryCgroup(1, memory / "slot", memory)
    assert probe.limit_bytes() == 1 * GiB


def test_cpu_platform_probe_uses_the_cgroup(host: FakeHost) -> None:
    memory = v1_host(host, "/slot")
    host.v1_level(memory / "slot", limit=2 * GiB, usage=1 * GiB, inactive=256 * MiB)
    probe = CpuPlatform(cgroup=host.probe())

    assert probe.total_bytes() == 2 * GiB
    assert probe.available_bytes() == 2 * GiB - (1 * GiB - 256 * MiB)
    assert probe.used_by_process_bytes() > 0
    assert probe.describe() == f"cgroup v1 {memory / 'slot'}, limit 2.00 GiB"


def test_module_helpers_still_work() -> None:
    assert process_rss_bytes() > 0
    assert CpuPlatform().total_bytes() >= CpuPlatform().available_bytes() > 0
    if reset_peak_rss():
        assert peak_rss_bytes() > 0


# --- the real machine -------------------------------------------------------------------------------------


def _real_v1_memory_cgroup() -> tuple[MemoryCgroup, str]:
    """The resolved cgroup and its /proc/self/cgroup path when that names a mounted, non-root v1 memory
    cgroup; else skip (v2-only hosts, bare root cgroups)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as e:
        pytest.skip(f"/proc/self/cgroup unreadable: {e}")
    fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    paths = [path for _, controllers, path in fields if "memory" in controllers.split(",")]
    if not paths or paths[0].strip("/") == "":
        pytest.skip("this process is not in a non-root cgroup v1 memory cgroup")
    cgroup = CgroupMemory().cgroup
    if cgroup is None or cgroup.version != 1:
        pytest.skip("the v1 memory controller is not mounted here")
    return cgroup, paths[0]


def test_real_machine_resolves_the_process_cgroup_not_the_root() -> None:
    cgroup, own_path = _real_v1_memory_cgroup()

    assert cgroup.directory != cgroup.mount_point
    assert cgroup.directory.is_dir()
    assert (cgroup.directory / "memory.limit_in_bytes").is_file()
    # The kernel lists this process in that directory: it is the process's own cgroup.
    assert str(os.getpid()) in (cgroup.directory / "cgroup.procs").read_text().split()
    direct = cgroup.mount_point / own_path.lstrip("/")
    if direct.is_dir():  # the mount root is "/" (no container subtree): mount point + path
        assert cgroup.directory == direct


_CHILD_SCRIPT = """
import json, sys
sys.stdin.readline()  # wait until the parent has moved this process into the child cgroup
from tideserve.platform.cpu import CpuPlatform
probe = CpuPlatform()
print(json.dumps({"total": probe.total_bytes(), "available": probe.available_bytes(),
                  "directory": str(probe.cgroup.cgroup.directory), "describe": probe.describe()}))
"""


def _remove_cgroup(directory: Path) -> None:
    """rmdir a v1 cgroup; the kernel may report it busy for a moment after its last task exits."""
    for _ in range(50):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    directory.rmdir()


@pytest.mark.slow  # starts a process
def test_real_child_cgroup_limit_is_seen_by_a_process_inside_it() -> None:
    parent, _path = _real_v1_memory_cgroup()
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    child = parent.directory / f"tideserve-test-{uuid.uuid4().hex[:12]}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup under {parent.directory}: {e}")
    proc: subprocess.Popen[str] | None = None
    try:
        try:
            (child / "memory.limit_in_bytes").write_text(str(2 * GiB))
        except OSError as e:
            pytest.skip(f"cannot set a memory limit on {child}: {e}")
        limit = int((child / "memory.limit_in_bytes").read_text())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                       os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_SCRIPT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env)
        (child / "cgroup.procs").write_text(str(proc.pid))
        out, err = proc.communicate("go\n", timeout=180)
        assert proc.returncode == 0, err
        seen = json.loads(out.strip().splitlines()[-1])
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        _remove_cgroup(child)

    assert not child.exists()
    assert seen["directory"] == str(child)
    assert seen["total"] == min(limit, CgroupMemory().total_bytes())
    assert 0 < seen["available"] <= limit
    assert seen["describe"] == f"cgroup v1 {child}, limit {limit / GiB:.2f} GiB"
