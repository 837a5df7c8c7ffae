"""The library's ABI in one place: every function a C file exports is declared in tideserve_native.h, every
declared function is exported and has ctypes argtypes in tideserve/native/__init__.py, with as many
arguments and a matching return type."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from tideserve import native

HEADER = Path(native.__file__).with_name("tideserve_native.h")
# A prototype or definition at the start of a line: return type, ts_ name, parameter list.
PROTOTYPE = re.compile(r"^(?:const\s+)?(\w+)\s*\*?\s*(ts_\w+)\(([^)]*)\)", re.MULTILINE)
RESTYPES = {"void": None, "int": ctypes.c_int, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64}


def _declarations(text: str) -> dict[str, tuple[str, int]]:
    """name -> (return type, number of parameters) of every ts_ function declared or defined in ``text``."""
    found = {}
    for restype, name, params in PROTOTYPE.findall(text):
        params = " ".join(params.split())
        found[name] = (restype, 0 if params in ("", "void") else params.count(",") + 1)
    return found


def test_every_exported_function_is_declared_in_the_header():
    declared = _declarations(HEADER.read_text())
    for source in native.SOURCES:
        for name, signature in _declarations(source.read_text()).items():
            assert declared.get(name) == signature, f"{source.name}: {name} {signature} vs header {declared.get(name)}"
    assert all(HEADER.name in source.read_text() for source in native.SOURCES)
    assert HEADER in native.HEADERS  # part of the build's cache key


def test_every_declared_function_has_matching_argtypes():
    lib = native.load_library()
    if lib is None:
        pytest.skip("no C compiler to build the kernels")
    for name, (restype, num_params) in _declarations(HEADER.read_text()).items():
        fn = getattr(lib, name)  # AttributeError: declared but not exported
        assert fn.argtypes is not None, f"{name} has no argtypes in tideserve/native/__init__.py"
        assert len(fn.argtypes) == num_params, f"{name}: {len(fn.argtypes)} argtypes for {num_params} parameters"
        assert fn.restype is RESTYPES[restype], f"{name}: restype {fn.restype} for C {restype}"


def test_every_header_is_part_of_the_build_key():
    """A header left out of HEADERS would let an edit to it reuse a library built before the edit."""
    folder = HEADER.parent
    assert sorted(folder.glob("*.h")) == sorted(native.HEADERS)
