"""Two real ``tideserve serve`` processes in ONE memory cgroup, bursting in turn (benchmarks/cotenancy.py,
run small, elastic mode only): each bursting server grows past what a static half split would have given
it, the two pools together stay within the shared room, nothing fails or is OOM-killed, and the burster
gives its memory back on its own once idle.

Needs root and a writable memory cgroup; skipped with the reason otherwise. Every wait is bounded (server
start-up, each request, the settle and recovery polls), so a broken server fails the test instead of
hanging it. About 140 s on 2 cores.

The burst is 32 requests of ~160 + 16 tokens, so that R (~230 MB of float32 KV) is large against what a
server keeps above its idle floor after its own burst (allocator and cache state, 0-50 MB measured): with
12 requests (R ~110 MB) that alone sometimes left the second burster under R / 2.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cotenancy.py"
SHRINK_DELAY_S = 1.0


def load_benchmark() -> ModuleType:
    """benchmarks/ is not a package: load the script by its path (registered so its dataclasses resolve)."""
    if "cotenancy" in sys.modules:
        return sys.modules["cotenancy"]
    spec = importlib.util.spec_from_file_location("cotenancy", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cotenancy"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cotenancy(smollm2_gguf_path) -> ModuleType:
    """The benchmark module, once this machine has shown it can create a child cgroup and limit it."""
    bench = load_benchmark()
    try:
        probe = bench.Cgroup.create(f"tideserve-cotenancy-probe-{os.getpid()}")
    except bench.CgroupUnavailable as exc:
        pytest.skip(f"needs a memory cgroup this process can create and limit: {exc}")
    try:
        probe.set_limit(1 << 40)
    except OSError as exc:
        pytest.skip(f"cannot write a memory limit on {probe.path}: {exc}")
    finally:
        probe.remove()
    return bench


@pytest.fixture(scope="module")
def result(cotenancy: ModuleType) -> dict:
    """One calibration, then both modes: bursts in turn (``elastic``) and at once (``joint``)."""
    return cotenancy.run_benchmark(cotenancy.parse_args([
        "--modes", "elastic,joint", "--num-requests", "32", "--prompt-tokens", "160", "--output-tokens", "16",
        "--bursts", "1", "--shrink-delay", str(SHRINK_DELAY_S),
        "--server-args", "--dtype float32 --max-model-len 512",
        "--ready-timeout", "120", "--request-timeout", "240"]))


def test_elastic_servers_share_one_cgroup_limit(result: dict) -> None:
    sizing, calibration, run = result["sizing"], result["calibration"], result["modes"]["elastic"]
    assert "error" not in run, run.get("error")
    room = sizing["room_bytes"]
    assert sizing["memory_binds"], f"the workload does not make memory bind: {sizing}"

    assert run["failed"] == 0, run["errors"]
    assert run["oom_kills"] == 0
    assert all(run["alive"]), f"a server died: {run['alive']} (logs {run['logs']})"
    assert len(run["bursts"]) == 2
    for burst in run["bursts"]:
        # A static half split would have given each server R/2; the elastic one held more than that, in
        # its pool and in live KV at once: the servers shared the limit rather than being capped at half.
        assert burst["peak_pool_bytes"] > room / 2, (burst, room, run["limit_bytes"], run["idle_working_set_bytes"])
        assert burst["peak_used_bytes"] > room / 2, (burst, room)
        assert burst["recovery_s"] is not None and burst["recovery_s"] <= SHRINK_DELAY_S + 5, (
            f"server {burst['server']}'s pool was not back near its floor {burst['floor_bytes']:.0f} B within "
            f"{SHRINK_DELAY_S + 5:.0f} s of its burst: {burst}")
    # Both pools together never took more than the limit leaves above the idle servers (their floors
    # included): room R, the activation peak and the safety margin the limit was sized with.
    allowed = sizing["limit_bytes"] - calibration["idle_usage_bytes"] + sum(calibration["idle_pool_bytes"])
    assert run["peak_pool_sum_bytes"] <= allowed, (run["peak_pool_sum_bytes"], allowed)
    # The limit is set once the run's servers are warm and idle: their working set less their pools, plus
    # what the sizing puts above that.
    assert run["limit_bytes"] > run["idle_working_set_bytes"]
    assert run["peak_cgroup_bytes"] <= run["limit_bytes"]


def test_a_joint_burst_beyond_the_limit_kills_nothing_and_fails_nothing(result: dict) -> None:
    """Both servers burst at the same moment, together wanting about twice the room the limit leaves: each
    grows only into headroom the other has not claimed (their memory ledger), the rest of the requests
    wait or are preempted, and every request finishes; nobody is OOM-killed."""
    sizing, run = result["sizing"], result["modes"]["joint"]
    assert "error" not in run, run.get("error")
    assert 2 * sizing["burst_kv_bytes"] > sizing["room_bytes"] * 1.5  # the two bursts want more than the limit
    assert run["failed"] == 0, run["errors"]
    assert run["oom_kills"] == 0
    assert all(run["alive"]), f"a server died: {run['alive']} (logs {run['logs']})"
    assert run["peak_cgroup_bytes"] <= run["limit_bytes"]
    assert len(run["bursts"]) == 2 and run["bursts"][0]["start_s"] == pytest.approx(run["bursts"][1]["start_s"],
                                                                                     abs=0.5)
    # Each saw the other's claims on the limit while they burst: the headroom was shared, not raced for.
    assert all(claimed > 0 for claimed in run["peak_others_claimed_bytes"]), run["peak_others_claimed_bytes"]
    assert run["ttft_p99_ms"] > 0 and run["output_tok_s_overall"] > 0  # reported, as the benchmark's table shows
