"""benchmarks/compare.py over several rounds: each cell of the main table is one real run (the median
round), and the rounds table gives every round's ratio against tideserve in the same round."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_compare() -> ModuleType:
    """benchmarks/ is not a package: load the script by its path (it imports its neighbours by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("compare_script", BENCHMARKS / "compare.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def row(engine: str, tps: float, round_no: int, ttft: float) -> dict:
    metrics = {"output_throughput": tps, "ttft_ms": {"median": ttft, "p99": ttft}, "e2el_ms": {},
               "tpot_ms": {}, "completed": 8, "failed": 0}
    return {"engine": engine, "workload": "fixed", "concurrency": 1, "metrics": metrics, "round": round_no}


def test_each_cell_is_its_median_round_and_every_round_has_its_own_ratio():
    compare = load_compare()
    rows = [row("tideserve-serve", 30.0, 1, 800), row("llama-server", 22.0, 1, 2400),
            row("tideserve-serve", 24.0, 2, 900), row("llama-server", 21.0, 2, 2300),
            row("tideserve-serve", 33.0, 3, 700), row("llama-server", 19.0, 3, 2500)]
    picked = {r["engine"]: r for r in compare.median_rows(rows)}
    assert picked["tideserve-serve"]["round"] == 1 and picked["llama-server"]["round"] == 2
    table = compare.build_table(rows)
    assert "| fixed | 1 | tideserve-serve | 30.0 | 1.00x | 800 |" in table  # round 1's TTFT, not a mix
    assert "| fixed | 1 | llama-server | 21.0 | 0.70x | 2300 |" in table
    rounds = compare.build_rounds_table(rows)
    assert "| fixed | 1 | llama-server | 22.0 | 21.0 | 19.0 | 0.73x, 0.88x, 0.58x | 0.73x |" in rounds
    assert compare.build_rounds_table(rows[:2]) == ""  # one round: no second table
    assert "| 0.73x, 0.88x | 0.80x |" in compare.build_rounds_table(rows[:4])  # an even count: the middle two's mean


def test_rounds_must_be_positive():
    compare = load_compare()
    assert compare.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        compare.parse_args(["--rounds", "0"])
