"""The core (scheduler, KV cache manager, elastic policy, memory probes) is plain Python: importing every
module of ``tideserve.core`` must succeed in a process where torch cannot be imported at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import importlib, pkgutil, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test ({name})")
        return None

sys.meta_path.insert(0, BlockTorch())
import tideserve.core
names = ["tideserve.core"]
for info in pkgutil.walk_packages(tideserve.core.__path__, "tideserve.core."):
    importlib.import_module(info.name)
    names.append(info.name)
assert "torch" not in sys.modules
print(" ".join(names))
"""


def _import_core_without_torch(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})


@pytest.mark.slow  # starts a process
def test_core_imports_with_torch_blocked() -> None:
    done = _import_core_without_torch(REPO_ROOT)
    assert done.returncode == 0, done.stderr
    imported = done.stdout.split()
    assert {"tideserve.core.scheduler", "tideserve.core.kv_cache.manager", "tideserve.core.kv_cache.memory",
            "tideserve.core.kv_cache.elastic", "tideserve.core.kv_cache.block_pool"} <= set(imported)


@pytest.mark.slow  # starts a process
def test_the_block_catches_a_torch_import(tmp_path: Path) -> None:
    """The finder really blocks torch: a core module that imports it fails the same script."""
    package = tmp_path / "tideserve"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "uses_torch.py").write_text("import torch\n")
    done = _import_core_without_torch(tmp_path)
    assert done.returncode != 0 and "torch is blocked" in done.stderr
