"""The KV pool on a CUDA device as one mapped range of addresses: resizes map and unmap memory in place.

Why: a pool held as one tensor per size (``CopyKVStore``) copies its blocks into a new tensor at every resize
and needs the old and the new tensor at once, so an elastic pool can only grow to about half the free
memory, and a growth fails exactly when memory is tight. The CUDA driver separates addresses from memory
(virtual memory management), which gives the GPU what ``ReservedKVStore`` does on the host:

- **Layout.** One range of device addresses is reserved (``cuMemAddressReserve``) for the largest pool the
  device could hold, with no memory behind it. It is cut into ``2 * num_layers`` equal regions, one for each
  layer's K and one for its V, each a whole number of the driver's granules (its allocation granularity,
  ``cuMemGetAllocationGranularity``: 2 MiB on current GPUs). A layer's K (or V) is always the start of its
  region: one contiguous ``[num_blocks, block_size, heads, dim]`` tensor at a fixed address.
- **Mapping.** Memory comes in rows: row ``g`` is granule ``g`` of every region, one physical allocation
  (``cuMemCreate`` of ``regions * granularity`` bytes) mapped piece by piece into each region
  (``cuMemMap`` at an offset of the allocation), made readable and writable (``cuMemSetAccess``) and zeroed.
  A pool of ``n`` blocks maps ``ceil(n * block_size * token_bytes / granularity)`` rows. Growing maps the
  missing rows; shrinking waits for the device to finish what it was given, then unmaps the rows past the
  new end (``cuMemUnmap``), and the driver frees a row's memory with its last mapping (the allocation's
  handle is released, ``cuMemRelease``, as soon as it is mapped). Nothing is copied, old and new storage
  never coexist, and a resize costs time in proportion to the rows it maps or unmaps. The row is the unit:
  while the pool holds anything, at least ``regions * granularity`` bytes are mapped (120 MiB for 30 layers).
- **Failure.** Before each row a growth asks ``commit_guard`` (the machine must keep its floor free, as the
  host store asks before each chunk of pages); a row the driver cannot back (out of memory) or a refused
  guard unmaps every row this growth mapped and raises ``KVStoreGrowError``: the store is as it was.
- **How torch sees it.** A ``__cuda_array_interface__`` over the whole reservation (``[regions, region
  bytes]`` of uint8), made once its first row is mapped (torch asks the driver which device a pointer
  belongs to), viewed per layer in the cache dtype: no copy. The same range gives ``fixed_caches``, each
  layer's K and V over its whole region, whose addresses and shapes no resize changes: a CUDA graph captured
  over them (worker/cuda_graphs.py) stays valid while the pool grows and shrinks.
- **Binding.** The driver is reached through cuda-bindings (``cuda.bindings.driver``, NVIDIA's binding of
  the driver API alone, tied to no torch build), imported on first use; ``pip install 'tideserve[cuda]'``
  installs it. Without it, or where the device lacks virtual memory management, ``create_kv_store``
  falls back to ``CopyKVStore`` and the start-up log says why.

The driver calls go through ``DriverVMM``; tests hand the store a double of the driver's module (host memory
behind fake device addresses), so the layout, the row arithmetic and the failure paths run without a GPU.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tideserve.core.kv_cache.geometry import KVStoreLimits
from tideserve.worker.kv_store_base import (
    KVLayout,
    KVStore,
    KVStoreGrowError,
    fill_region_slots,
    region_bytes_for,
    region_views,
)

logger = logging.getLogger(__name__)
GiB, MiB = 2**30, 2**20
BINDING_HINT = "pip install 'tideserve[cuda]' (cuda-bindings)"


# ----------------------------------------------------------------------------------------- arithmetic
def rows_for(end_bytes: int, granularity: int) -> int:
    """Rows (granules of every region) that hold the first ``end_bytes`` of each region."""
    return -(-max(0, end_bytes) // granularity)


@dataclass(frozen=True)
class RegionPlan:
    """Where each layer's K and V live in the reservation, and how much of it a pool maps."""

    num_regions: int  # 2 * num_layers: K of layer i is region 2i, its V region 2i + 1
    region_bytes: int  # each region: a whole number of granules
    granularity: int
    token_bytes: int  # one token of one layer's K (or V)

    @classmethod
    def for_reservation(cls, layout: KVLayout, reserve_bytes: int, granularity: int) -> RegionPlan:
        regions = 2 * layout.num_layers
        return cls(regions, region_bytes_for(reserve_bytes, regions, granularity), granularity, layout.token_bytes)

    @property
    def reserve_bytes(self) -> int:
        return self.num_regions * self.region_bytes

    @property
    def capacity_tokens(self) -> int:
        """Token slots each region holds: the largest pool, whatever the block size."""
        return self.region_bytes // self.token_bytes

    @property
    def row_bytes(self) -> int:
        """Device memory behind one row (one granule of every region)."""
        return self.num_regions * self.granularity

    def end_bytes(self, num_blocks: int, block_size: int) -> int:
        """Bytes of each region a pool of ``num_blocks`` uses."""
        return num_blocks * block_size * self.token_bytes

    def rows(self, num_blocks: int, block_size: int) -> int:
        return rows_for(self.end_bytes(num_blocks, block_size), self.granularity)

    def mapped_bytes(self, num_blocks: int, block_size: int) -> int:
        """Device memory a pool of ``num_blocks`` holds: its rows, the last one partly unused."""
        return self.rows(num_blocks, block_size) * self.row_bytes

    def granule_address(self, base: int, region: int, row: int) -> int:
        return base + region * self.region_bytes + row * self.granularity


# ----------------------------------------------------------------------------------------- the driver
class VMMError(RuntimeError):
    """A driver call failed; ``out_of_memory`` when the device had no memory for it."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code
        self.out_of_memory = code == "CUDA_ERROR_OUT_OF_MEMORY"


def _vmm_attribute(driver: Any) -> Any:
    """The device attribute that says whether it supports virtual memory management (the binding names it
    VIRTUAL_ADDRESS_MANAGEMENT in some versions, the driver's older name)."""
    attrs = driver.CUdevice_attribute
    for name in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED"):
        if hasattr(attrs, name):
            return getattr(attrs, name)
    raise AttributeError("cuda.bindings.driver names no virtual memory management attribute")


def _cuda_array(ptr: int, shape: tuple[int, int], device: torch.device, owner: Any) -> torch.Tensor:
    """A uint8 CUDA tensor over ``shape`` bytes at ``ptr``, no copy; ``owner`` lives as long as the tensor."""
    return torch.as_tensor(_ArrayInterface(ptr, shape, owner), device=device)


class _ArrayInterface:
    """``__cuda_array_interface__`` (version 3) of bytes at a device address; torch keeps this object, and
    with it ``owner`` (the reservation), alive as long as any view of the tensor made from it."""

    def __init__(self, ptr: int, shape: tuple[int, int], owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 3}


class DriverVMM:
    """The driver calls the mapped store makes, for one device, each checked (``VMMError`` names the call
    and the driver's error). ``driver`` is ``cuda.bindings.driver`` (or a test's double of it); ``as_tensor``
    turns a mapped address into a torch tensor (default: a CUDA tensor through ``__cuda_array_interface__``)
    and ``synchronize`` waits for the device (default: ``torch.cuda.synchronize``)."""

    def __init__(self, driver: Any, ordinal: int,
                 as_tensor: Callable[[int, tuple[int, int], Any], torch.Tensor] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.driver = d = driver
        self.ordinal = ordinal
        self.torch_device = torch.device("cuda", ordinal)
        self._as_tensor = as_tensor
        self._synchronize = synchronize
        self._check(d.cuInit(0), "cuInit")
        self._dev = self._check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        self.supported = bool(self._check(d.cuDeviceGetAttribute(_vmm_attribute(d), self._dev),
                                          "cuDeviceGetAttribute"))
        self._ctx = None
        if not self.supported:
            return
        # The device's primary context, which torch uses too: current on whichever thread resizes the pool.
        self._ctx = self._check(d.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        minimum = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(self._check(d.cuMemGetAllocationGranularity(prop, minimum),
                                           "cuMemGetAllocationGranularity"))

    def _check(self, result: tuple, call: str) -> Any:
        err = result[0]
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise VMMError(call, getattr(err, "name", str(err)))
        return result[1] if len(result) > 1 else None

    def _current(self) -> None:
        self._check(self.driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def reserve(self, size: int) -> int:
        self._current()
        return int(self._check(self.driver.cuMemAddressReserve(size, self.granularity, 0, 0), "cuMemAddressReserve"))

    def free(self, ptr: int, size: int) -> None:
        self._check(self.driver.cuMemAddressFree(ptr, size), "cuMemAddressFree")

    def create(self, size: int) -> Any:
        self._current()
        return self._check(self.driver.cuMemCreate(size, self._prop, 0), "cuMemCreate")

    def map(self, ptr: int, size: int, handle: Any, offset: int) -> None:
        self._check(self.driver.cuMemMap(ptr, size, offset, handle, 0), "cuMemMap")

    def set_access(self, ptr: int, size: int) -> None:
        self._check(self.driver.cuMemSetAccess(ptr, size, self._access, 1), "cuMemSetAccess")

    def unmap(self, ptr: int, size: int) -> None:
        self._check(self.driver.cuMemUnmap(ptr, size), "cuMemUnmap")

    def release(self, handle: Any) -> None:
        self._check(self.driver.cuMemRelease(handle), "cuMemRelease")

    def tensor(self, ptr: int, shape: tuple[int, int], owner: Any) -> torch.Tensor:
        if self._as_tensor is not None:
            return self._as_tensor(ptr, shape, owner)
        return _cuda_array(ptr, shape, self.torch_device, owner)

    def synchronize(self) -> None:
        """Wait for the device: nothing queued may still read or write memory about to be unmapped."""
        if self._synchronize is not None:
            self._synchronize()
        else:
            torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        if self._ctx is not None:
            self.driver.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None


def open_vmm(device: torch.device) -> tuple[DriverVMM | None, str]:
    """The driver's virtual memory management for ``device``, or None and why it cannot be had (the binding
    is not installed, the driver does not load, the device does not support it)."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return None, f"cuda-bindings is not installed ({BINDING_HINT})"
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    try:
        vmm = DriverVMM(driver, ordinal)
    except Exception as exc:  # the binding's loader raises its own types when the driver is missing
        return None, f"the CUDA driver could not be used through cuda-bindings ({exc})"
    if not vmm.supported:
        return None, f"the driver reports no virtual memory management on cuda:{ordinal}"
    return vmm, ""


# ----------------------------------------------------------------------------------------- the range
class _MappedRange:
    """The reservation and its mapped rows. Kept apart from the store so that views of it (through the
    array interface) keep it alive, and the finalizer can release it without the store."""

    def __init__(self, vmm: DriverVMM, plan: RegionPlan) -> None:
        self.vmm = vmm
        self.plan = plan
        self.base = vmm.reserve(plan.reserve_bytes)
        self.rows = 0
        self._mapped = [0]  # the rows, shared with the finalizer (which must not hold this object)
        self._finalizer = weakref.finalize(self, _release_range, vmm, plan, self.base, self._mapped)
        self._finalizer.atexit = False  # at exit the driver reclaims everything; its context may be gone

    def _set_rows(self, rows: int) -> None:
        self.rows = rows
        self._mapped[0] = rows

    def map_rows(self, rows: int, guard: Callable[[int], bool] | None) -> None:
        """Map rows ``[self.rows, rows)``; on any failure unmap what this call mapped and raise
        ``KVStoreGrowError`` (nothing changed)."""
        vmm, plan, start = self.vmm, self.plan, self.rows
        done = start
        try:
            for row in range(start, rows):
                if guard is not None and not guard(plan.row_bytes):
                    raise KVStoreGrowError("the machine's free memory fell under the floor while the pool's memory "
                                           "was being mapped")
                handle = vmm.create(plan.row_bytes)
                mapped = 0
                try:
                    for region in range(plan.num_regions):
                        vmm.map(plan.granule_address(self.base, region, row), plan.granularity, handle,
                                region * plan.granularity)
                        mapped += 1
                except VMMError:
                    for region in range(mapped):
                        vmm.unmap(plan.granule_address(self.base, region, row), plan.granularity)
                    raise
                finally:
                    vmm.release(handle)  # the memory now lives as long as its mappings
                done = row + 1
            if rows > start:
                for region in range(plan.num_regions):
                    vmm.set_access(plan.granule_address(self.base, region, start), (rows - start) * plan.granularity)
        except (VMMError, KVStoreGrowError) as exc:
            self._unmap(start, done, synchronize=False)  # never handed out: nothing can be using it
            if isinstance(exc, KVStoreGrowError):
                raise
            what = "out of device memory" if exc.out_of_memory else "the driver refused"
            raise KVStoreGrowError(f"{what} mapping {(rows - start) * plan.row_bytes / MiB:.0f} MiB of KV memory "
                                   f"({exc})") from exc
        self._set_rows(rows)

    def unmap_rows(self, rows: int) -> None:
        """Unmap rows ``[rows, self.rows)`` once the device has finished everything queued."""
        if rows < self.rows:
            self._unmap(rows, self.rows, synchronize=True)
            self._set_rows(rows)

    def _unmap(self, lo: int, hi: int, synchronize: bool) -> None:
        if hi <= lo:
            return
        if synchronize:
            self.vmm.synchronize()
        for row in range(hi - 1, lo - 1, -1):
            for region in range(self.plan.num_regions):
                self.vmm.unmap(self.plan.granule_address(self.base, region, row), self.plan.granularity)

    def close(self) -> None:
        if self._finalizer.alive:
            self.unmap_rows(0)
            self._finalizer()


def _release_range(vmm: DriverVMM, plan: RegionPlan, base: int, rows: list[int]) -> None:
    """Unmap every row and free the reservation (best effort: the device may be gone)."""
    try:
        for row in range(rows[0]):
            for region in range(plan.num_regions):
                vmm.unmap(plan.granule_address(base, region, row), plan.granularity)
        rows[0] = 0
        vmm.free(base, plan.reserve_bytes)
        vmm.close()
    except Exception as exc:
        logger.debug("releasing the KV range failed: %s", exc)


# ----------------------------------------------------------------------------------------- the store
class MappedKVStore(KVStore):
    """The elastic pool over one reserved range of device addresses (see the module docstring)."""

    def __init__(self, layout: KVLayout, device: torch.device, block_size: int, num_blocks: int,
                 reserve_bytes: int, vmm: DriverVMM) -> None:
        """``reserve_bytes``: the largest pool ever (addresses only); ``vmm``: the driver for ``device``."""
        super().__init__(layout, device, block_size)
        self.vmm = vmm
        self.plan = RegionPlan.for_reservation(layout, reserve_bytes, vmm.granularity)
        self.capacity_tokens = self.plan.capacity_tokens
        self._range = _MappedRange(vmm, self.plan)
        self._raw: torch.Tensor | None = None  # [regions, region_bytes] uint8, once the first row is mapped
        self._regions: torch.Tensor | None = None  # the same in the cache dtype
        self._fixed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        try:
            self.resize(num_blocks)
        except BaseException:
            self.close()
            raise

    @classmethod
    def try_create(cls, layout: KVLayout, device: torch.device, block_size: int, num_blocks: int,
                   reserve_bytes: int, vmm: DriverVMM | None = None) -> tuple[MappedKVStore | None, str]:
        """The store, or None and why not: the driver cannot be had (``open_vmm``), or it would not reserve
        a range that holds ``num_blocks`` (halved from ``reserve_bytes`` until it does), or torch would not
        view the range. An initial pool the device has no memory for raises ``KVStoreGrowError``."""
        if vmm is None:
            vmm, why = open_vmm(device)
            if vmm is None:
                return None, why
        need = num_blocks * layout.block_bytes(block_size)
        size = max(reserve_bytes, need)
        while True:
            try:
                return cls(layout, device, block_size, num_blocks, size, vmm), ""
            except VMMError as exc:
                if size // 2 < need or size // 2 < 2 * layout.num_layers * vmm.granularity:
                    return None, f"the driver would not reserve {size / GiB:.1f} GiB of device addresses ({exc})"
                size //= 2
            except (TypeError, ValueError, RuntimeError) as exc:
                if isinstance(exc, KVStoreGrowError):
                    raise
                return None, f"torch could not view the mapped range ({exc})"

    # ----------------------------------------------------------------- numbers
    @property
    def granularity(self) -> int:
        return self.plan.granularity

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    @property
    def mapped_rows(self) -> int:
        return self._range.rows

    @property
    def mapped_bytes(self) -> int:
        """Device memory mapped now (the pool rounded up to whole rows)."""
        return self._range.rows * self.plan.row_bytes

    @property
    def bytes_outside_allocator(self) -> int:
        # The pool's bytes as the engine counts them; torch's allocator never sees this memory.
        return self.pool_bytes

    def limits(self) -> KVStoreLimits:
        return KVStoreLimits(copies_on_resize=False, capacity_tokens=self.capacity_tokens)

    def describe(self) -> str:
        plan = self.plan
        return (f"mapped device range on {self.device} ({plan.reserve_bytes / GiB:.1f} GiB of addresses, "
                f"{plan.num_regions} regions, one per layer's K and V; {plan.granularity / MiB:.0f} MiB granules, "
                f"so memory is mapped in rows of {plan.row_bytes / MiB:.0f} MiB): resizes map and unmap memory "
                "in place, nothing is copied")

    # ----------------------------------------------------------------- views
    @property
    def fixed_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if self._regions is None:
            return None
        if self._fixed is None:
            self._fixed = region_views(self._regions, self.layout, self.capacity_blocks, self.block_size)
        return self._fixed

    def _view_range(self) -> None:
        """Torch's view of the whole reservation, made once its first row is mapped."""
        if self._raw is not None or self._range.rows == 0:
            return
        plan = self.plan
        raw = self.vmm.tensor(self._range.base, (plan.num_regions, plan.region_bytes), self._range)
        elem = torch.empty((), dtype=self.layout.dtype).element_size()
        self._raw = raw
        self._regions = raw[:, :plan.region_bytes // elem * elem].view(self.layout.dtype)

    def _build_views(self) -> None:
        if self._regions is None:  # nothing mapped yet: empty tensors of the right shape
            L = self.layout
            empty = torch.empty((0, self.block_size, L.num_kv_heads, L.head_dim), dtype=L.dtype, device=self.device)
            self.caches = [(empty, empty) for _ in range(L.num_layers)]
            return
        self.caches = region_views(self._regions, self.layout, self.num_blocks, self.block_size)

    # ----------------------------------------------------------------- moves
    def _map_to(self, rows: int) -> None:
        """Map or unmap rows until ``rows`` are mapped; new rows read as zeros."""
        before = self._range.rows
        if rows > before:
            self._range.map_rows(rows, self.commit_guard)  # KVStoreGrowError: nothing changed
            try:
                self._view_range()
            except BaseException:
                self._range.unmap_rows(before)
                raise
            g = self.plan.granularity
            self._raw[:, before * g:rows * g].zero_()  # type: ignore[index]
        elif rows < before:
            self._range.unmap_rows(rows)

    def resize(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}.")
        if num_blocks > self.capacity_blocks:
            raise KVStoreGrowError(f"{num_blocks} blocks exceed the reservation of {self.capacity_blocks}")
        self._map_to(self.plan.rows(num_blocks, self.block_size))
        self.num_blocks = num_blocks
        self._build_views()

    def reshape_blocks(self, new_block_size: int) -> int:
        tokens = self.num_blocks * self.block_size
        new_num = max(1, tokens // new_block_size)
        if new_num * new_block_size > self.capacity_tokens:
            raise KVStoreGrowError(f"block size {new_block_size} does not fit the reservation")
        self._map_to(self.plan.rows(new_num, new_block_size))
        self.block_size = new_block_size
        self.num_blocks = new_num
        self._fixed = None
        self._build_views()
        return new_num

    def release_pages(self) -> None:
        """Unmap every row (the pool's geometry stays; its views must not be read until restored)."""
        self._map_to(0)

    def restore_pages(self) -> None:
        """Map the pool's rows again, zeroed, at the same addresses."""
        self._map_to(self.plan.rows(self.num_blocks, self.block_size))

    def fill_slots(self, slots: torch.Tensor, value: float = 0.0) -> None:
        if self._regions is not None and slots.numel():
            fill_region_slots(self._regions, self.layout, self.num_blocks * self.block_size, slots, value)

    def close(self) -> None:
        self.caches, self._fixed, self._raw, self._regions = [], None, None, None
        self._range.close()
        self.num_blocks = 0
