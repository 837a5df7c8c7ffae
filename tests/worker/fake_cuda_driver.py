"""A double of ``cuda.bindings.driver``'s virtual memory management, over host memory.

It speaks the binding's conventions (every call returns a tuple whose first item is a ``CUresult``; structs
with ``.location.type`` and the like; enums by the binding's names) and enforces the driver's rules the
mapped KV store relies on: sizes, addresses and offsets in whole granules, a mapping only inside a
reservation and over addresses not mapped yet, access set only over fully mapped ranges, an unmap that
covers whole mappings, a reservation freed only once nothing is mapped in it. A reservation is host
address space (an anonymous mapping); an allocation's memory is counted against ``memory_bytes`` until it
is released and its last mapping is gone. Newly mapped and unmapped bytes are overwritten with a poison
byte, so a store that read memory it did not map, or kept data it unmapped, would show it.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

POISON = 0xA5


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 (the binding's name)
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUdevice_attribute(enum.IntEnum):  # noqa: N801
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = 0
        self.location = SimpleNamespace(type=0, id=-1)


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.flags = 0
        self.location = SimpleNamespace(type=0, id=-1)


@dataclass
class _Allocation:
    size: int
    released: bool = False
    mappings: int = 0


@dataclass
class _Reservation:
    mem: mmap.mmap
    base: int
    size: int
    mapped: dict[int, tuple[int, int]] = field(default_factory=dict)  # address -> (size, handle)
    accessible: set[int] = field(default_factory=set)  # granule addresses with read/write access


class FakeDriver:
    """An instance stands in for the ``cuda.bindings.driver`` module (see the module docstring)."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, memory_bytes: int, granularity: int = 2 * 2**20, vmm: bool = True,
                 max_reserve_bytes: int | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.granularity = granularity
        self.vmm = vmm
        self.max_reserve_bytes = max_reserve_bytes
        self.calls: Counter[str] = Counter()
        self.allocations: dict[int, _Allocation] = {}
        self.reservations: dict[int, _Reservation] = {}
        self.fail_map_after: int | None = None  # cuMemMap calls that succeed before one fails (None: never)
        self.context_retained = 0
        self._next_handle = 1

    # ------------------------------------------------------------------ what tests read
    @property
    def used_bytes(self) -> int:
        """Device memory held: allocations not yet freed (unreleased, or still mapped somewhere)."""
        return sum(a.size for a in self.allocations.values())

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - self.used_bytes

    def host_tensor(self, ptr: int, shape: tuple[int, int], owner: object) -> torch.Tensor:
        """The store's ``as_tensor`` here: a CPU uint8 tensor over the host bytes at ``ptr``."""
        self._check_accessible(ptr, 1)

        class Bytes(ctypes.c_uint8 * (shape[0] * shape[1])):
            """The buffer torch keeps, keeping ``owner`` alive with it (as the array interface does)."""

        buffer = Bytes.from_address(ptr)
        buffer.owner = owner
        return torch.frombuffer(buffer, dtype=torch.uint8).view(shape)

    # ------------------------------------------------------------------ device and context
    def cuInit(self, flags: int) -> tuple:  # noqa: N802 (the binding's names)
        self.calls["cuInit"] += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        return (CUresult.CUDA_SUCCESS, ordinal)

    def cuDeviceGetAttribute(self, attribute, device) -> tuple:  # noqa: N802
        assert attribute == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return (CUresult.CUDA_SUCCESS, int(self.vmm))

    def cuDevicePrimaryCtxRetain(self, device) -> tuple:  # noqa: N802
        self.context_retained += 1
        return (CUresult.CUDA_SUCCESS, f"ctx{device}")

    def cuDevicePrimaryCtxRelease(self, device) -> tuple:  # noqa: N802
        self.context_retained -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx) -> tuple:  # noqa: N802
        assert ctx is not None
        return (CUresult.CUDA_SUCCESS,)

    def cuMemGetAllocationGranularity(self, prop, flags) -> tuple:  # noqa: N802
        self._check_prop(prop)
        return (CUresult.CUDA_SUCCESS, self.granularity)

    # ------------------------------------------------------------------ addresses
    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple:  # noqa: N802
        self.calls["cuMemAddressReserve"] += 1
        assert size % self.granularity == 0 and addr == 0 and flags == 0, (size, addr, flags)
        if self.max_reserve_bytes is not None and size > self.max_reserve_bytes:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        mem = mmap.mmap(-1, size + self.granularity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
        start = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        base = -(-start // self.granularity) * self.granularity  # aligned to the granule, as the driver does
        self.reservations[base] = _Reservation(mem, base, size)
        return (CUresult.CUDA_SUCCESS, base)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple:  # noqa: N802
        self.calls["cuMemAddressFree"] += 1
        res = self.reservations.get(ptr)
        assert res is not None and res.size == size, "cuMemAddressFree of a range that was not reserved"
        assert not res.mapped, "cuMemAddressFree while memory is still mapped"
        del self.reservations[ptr]
        return (CUresult.CUDA_SUCCESS,)

    def _reservation(self, ptr: int, size: int) -> _Reservation:
        for res in self.reservations.values():
            if res.base <= ptr and ptr + size <= res.base + res.size:
                return res
        raise AssertionError(f"address range {ptr:#x}+{size} is outside every reservation")

    # ------------------------------------------------------------------ memory
    def _check_prop(self, prop) -> None:
        assert prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and prop.location.id == 0

    def cuMemCreate(self, size: int, prop, flags: int) -> tuple:  # noqa: N802
        self.calls["cuMemCreate"] += 1
        self._check_prop(prop)
        assert size > 0 and size % self.granularity == 0 and flags == 0, size
        if size > self.free_bytes:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle = self._next_handle
        self._next_handle += 1
        self.allocations[handle] = _Allocation(size)
        return (CUresult.CUDA_SUCCESS, handle)

    def cuMemRelease(self, handle) -> tuple:  # noqa: N802
        self.calls["cuMemRelease"] += 1
        alloc = self.allocations[handle]
        assert not alloc.released, "cuMemRelease twice"
        alloc.released = True
        self._maybe_free(handle)
        return (CUresult.CUDA_SUCCESS,)

    def _maybe_free(self, handle: int) -> None:
        alloc = self.allocations[handle]
        if alloc.released and alloc.mappings == 0:
            del self.allocations[handle]

    def cuMemMap(self, ptr: int, size: int, offset: int, handle, flags: int) -> tuple:  # noqa: N802
        self.calls["cuMemMap"] += 1
        g = self.granularity
        assert ptr % g == 0 and size % g == 0 and offset % g == 0 and size > 0 and flags == 0
        alloc = self.allocations.get(handle)
        assert alloc is not None and not alloc.released, "cuMemMap of a released handle"
        assert offset + size <= alloc.size
        if self.fail_map_after is not None:
            if self.fail_map_after == 0:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
            self.fail_map_after -= 1
        res = self._reservation(ptr, size)
        for a, (s, _) in res.mapped.items():
            assert ptr + size <= a or a + s <= ptr, "cuMemMap over addresses already mapped"
        res.mapped[ptr] = (size, handle)
        alloc.mappings += 1
        ctypes.memset(ptr, POISON, size)  # fresh memory holds whatever it held
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr: int, size: int, desc, count: int) -> tuple:  # noqa: N802
        self.calls["cuMemSetAccess"] += 1
        assert count == len(desc) == 1
        (d,) = desc
        assert d.flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        assert d.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and d.location.id == 0
        res = self._reservation(ptr, size)
        for a in range(ptr, ptr + size, self.granularity):
            assert any(m <= a < m + s for m, (s, _) in res.mapped.items()), "cuMemSetAccess over unmapped addresses"
            res.accessible.add(a)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple:  # noqa: N802
        self.calls["cuMemUnmap"] += 1
        res = self._reservation(ptr, size)
        assert ptr in res.mapped and res.mapped[ptr][0] == size, "cuMemUnmap must cover a whole mapping"
        _, handle = res.mapped.pop(ptr)
        for a in range(ptr, ptr + size, self.granularity):
            res.accessible.discard(a)
        ctypes.memset(ptr, POISON, size)  # the data is gone
        self.allocations[handle].mappings -= 1
        self._maybe_free(handle)
        return (CUresult.CUDA_SUCCESS,)

    def _check_accessible(self, ptr: int, size: int) -> None:
        res = self._reservation(ptr, size)
        for a in range(ptr - ptr % self.granularity, ptr + size, self.granularity):
            assert a in res.accessible, f"{a:#x} is read before it is mapped and made accessible"

    # ------------------------------------------------------------------ checks for tests
    def mapped_bytes(self) -> int:
        return sum(s for res in self.reservations.values() for s, _ in res.mapped.values())
