"""Fixtures for the kernel tests: every instruction-set path this machine can run, one at a time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tideserve import native


@pytest.fixture(params=native.ISA_LEVELS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the kernels capped at one ISA level; a level this CPU (or build) lacks is skipped,
    named in the reason. The cap is lifted afterwards."""
    name = request.param
    if native.load_library() is None:
        pytest.skip("no C compiler to build the kernels")
    if name not in native.supported_isas():
        pytest.skip(f"this CPU or build has no {name} path (supported: {', '.join(native.supported_isas())})")
    assert native.set_isa(name) == name
    try:
        yield name
    finally:
        native.set_isa("auto")


@pytest.fixture
def on_scalar() -> Callable[..., Any]:
    """``on_scalar(fn, *args)``: fn's result computed on the scalar reference path (the level in use is
    restored after)."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        level = native.isa()
        native.set_isa("scalar")
        try:
            return fn(*args, **kwargs)
        finally:
            native.set_isa(level or "auto")

    return run


@pytest.fixture(autouse=True)
def best_path() -> Iterator[None]:
    """Each kernel test starts on the CPU's best path, attention's fastest forms included: an engine built
    earlier in the run keeps the kernels at or below native.BATCH_INVARIANT_CEILING and attention in its
    invariant mode (native.apply_batch_invariance)."""
    if native.load_library() is not None:
        native.set_attention_invariant(False)
        if "TIDESERVE_ISA" not in os.environ:
            native.set_isa("auto")
    yield
