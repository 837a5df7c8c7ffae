"""Runtime ISA dispatch: what the CPU reports decides the path, TIDESERVE_ISA / set_isa cap it, the choice is
logged once, and AMX works where it is reported (the permission request included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tideserve import native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_best_path_follows_the_cpu_flags():
    """On x86 Linux the levels follow /proc/cpuinfo: a path is offered only where the CPU has its units."""
    flags = cpu_flags()
    if not flags or "avx" not in flags:
        pytest.skip("no x86 /proc/cpuinfo flags here")
    supported = native.supported_isas()
    assert supported[0] == "scalar" and supported == list(native.ISA_LEVELS[: len(supported)])
    assert ("avx2" in supported) == ({"avx2", "fma", "f16c"} <= flags)
    assert ("avx512" in supported) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    assert ("avx512bf16" in supported) == ("avx512" in supported and "avx512_bf16" in flags)
    if "amx" in supported:
        assert {"amx_tile", "amx_bf16", "amx_int8"} <= flags
    features = native.load_library().ts_cpu_features()
    reported = {name for bit, name in enumerate(native.CPU_FEATURES) if features >> bit & 1}
    assert reported - {"amx_permitted", "vendor_intel"} <= flags
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    assert ("vendor_intel" in reported) == intel
    assert native.isa() == supported[-1]  # no cap: the best


def test_set_isa_caps_and_restores():
    best = native.isa()
    try:
        assert native.set_isa("scalar") == "scalar" and native.isa() == "scalar"
    finally:
        assert native.set_isa("auto") == best
    with pytest.raises(ValueError, match="isa 'sse9' is not supported here; supported: auto, scalar"):
        native.set_isa("sse9")
    assert native.isa() == best


def test_amx_tiles_run_where_amx_is_offered():
    """The AMX level means the kernel granted the tile state: one bf16 tile product runs and is exact."""
    if "amx" not in native.supported_isas():
        pytest.skip(f"this CPU or build has no amx path (supported: {', '.join(native.supported_isas())})")
    assert native.load_library().ts_amx_probe() == 1


def _fresh_process(env_isa: str) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from tideserve import native\n"
            "print('ISA', native.isa())\n")
    env = dict(os.environ, TIDESERVE_ISA=env_isa)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


@pytest.mark.slow  # starts a process
def test_tideserve_isa_caps_the_path_and_is_logged_once():
    proc = _fresh_process("scalar")
    assert proc.returncode == 0, proc.stderr
    assert "ISA scalar" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "native kernels:" in line]
    assert len(lines) == 1 and "scalar path" in lines[0]
    if native.isa() != "scalar":
        assert f"best here: {native.isa()}" in lines[0]
    bad = _fresh_process("avx1024")
    assert bad.returncode != 0 and "TIDESERVE_ISA='avx1024' is not one of auto, scalar" in bad.stderr


def test_batch_invariance_keeps_the_kernels_at_its_ceiling_and_the_flag_lifts_it(make_llm, monkeypatch, caplog):
    """An engine built with batch_invariant (the default) runs the kernels at most on the ceiling's path;
    --no-batch-invariant gives them the CPU's best; TIDESERVE_ISA, when set, wins over both. The ceiling is
    lowered to scalar here so that any CPU has a path above it."""
    if native.load_library() is None:
        pytest.skip("no C compiler to build the kernels")
    best = native.supported_isas()[-1]
    if best == "scalar":
        pytest.skip("this CPU has no path above scalar")
    monkeypatch.delenv("TIDESERVE_ISA", raising=False)
    monkeypatch.setattr(native, "BATCH_INVARIANT_CEILING", "scalar")
    monkeypatch.setattr(native, "_invariance_logged", None)
    try:
        with caplog.at_level("INFO", logger="tideserve.native"):
            make_llm(dtype="float32")
        assert native.isa() == "scalar"
        assert native.attention_isa(torch.bfloat16, 64) == "scalar"
        assert any("batch invariance: native kernels on scalar" in r.message for r in caplog.records)
        make_llm(dtype="float32", batch_invariant=False)
        assert native.isa() == best
        assert native.attention_isa(torch.bfloat16, 64) == best
        monkeypatch.setattr(native, "BATCH_INVARIANT_CEILING", best)  # the products keep the best path,
        make_llm(dtype="float32")  # attention its shared forms: vdpbf16ps for bfloat16 caches, else AVX2
        assert native.isa() == best
        levels = native.ISA_LEVELS
        rows = min(best, "avx2", key=levels.index)  # attn_rows.h's forms
        shared = "avx512bf16" if levels.index(best) >= levels.index("avx512bf16") else rows
        assert native.attention_isa(torch.bfloat16, 64) == shared
        assert native.attention_isa(torch.float32, 64) == rows
        assert native.attention_isa(torch.bfloat16, 48) == rows
        monkeypatch.setenv("TIDESERVE_ISA", "avx2" if "avx2" in native.supported_isas() else "scalar")
        native.set_isa("auto")
        assert native.apply_batch_invariance(True) == best  # the user's choice is left alone
    finally:
        native.set_isa("auto")
        native.set_attention_invariant(False)
