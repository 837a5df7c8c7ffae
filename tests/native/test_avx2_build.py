"""The kernels as an AVX2-only CPU builds them (an AMD EPYC of the Zen 2/3 kind, where -march=native has no
AVX-512), made and checked on a CPU with more. Elsewhere the suite checks the AVX2 paths by capping the ISA
at run time, but those are compiled with AVX-512 enabled: the compiler may then use 32 vector registers and
AVX-512 instructions in them, and an AVX-512 intrinsic outside its target pragma compiles here and fails
there. A build that fails only makes the native tests skip and the engine fall back to torch, silently
slow, so this builds the library with -march=haswell (benchmarks/avx2_emulation.sh) and runs the kernel
tests against it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tideserve import native

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "avx2_emulation.sh"
KERNEL_TESTS = ["test_qgemm.py", "test_paged_decode.py", "test_paged_prefill.py", "test_rows.py", "test_rope_store.py"]


def test_an_avx2_only_build_compiles_and_its_kernels_equal_the_scalar_path(tmp_path: Path) -> None:
    if native.load_library() is None:
        pytest.skip("no C compiler to build the kernels")
    if "avx512" not in native.supported_isas():
        pytest.skip("this CPU's own build has no AVX-512 paths: the other native tests already run an AVX2 build")
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIDESERVE_")}
    env.update(TIDESERVE_AVX2_EMULATION_DIR=str(tmp_path), TIDESERVE_AVX2_MARCH="haswell", CC=native.find_compiler())
    probe = subprocess.run(
        ["bash", str(SCRIPT), sys.executable, "-c",
         "from tideserve import native; from tideserve.native import quant;"
         "print(native.load_library() is not None, native.supported_isas()[-1], quant.cpu_isa())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["True", "avx2", "avx2"], probe.stdout + probe.stderr[-3000:]
    assert list((tmp_path / "cache" / "native").glob("tideserve_kernels-*.so")), "built outside the emulation's cache"
    # The AVX2-only build's library is cached now: the kernel tests on it, AVX2 path and best path.
    run = subprocess.run(
        ["bash", str(SCRIPT), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(f"tests/native/{name}" for name in KERNEL_TESTS), "-k", "avx2 or not (scalar or avx512 or amx)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed is not None and int(passed.group(1)) >= 100, tail
