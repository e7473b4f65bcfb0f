"""The host tier's memory: exactly the bytes of its slots, pinned for DMA on CUDA.

``torch.zeros(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every allocation up to a power of two (a 20 GiB host
tier would pin 32 GiB). As vLLM's own CPU offloading does, the pool is an
ordinary allocation of exactly ``num_slots * slot_bytes`` bytes (an anonymous
mapping: page aligned, zeroed by the kernel as it is touched) that is then
registered with ``cudaHostRegister``, in chunks that end on slot and page
boundaries (no page in two registrations, no page of a slot in two), and
unregistered on shutdown.

Hundreds of GiB: registering touches and locks every page, tens of seconds
per rank on one thread, so the chunks are registered by several threads at
once. Those threads run on the CPUs of the GPU's NUMA node (from
``/sys/bus/pci/devices/<bdf>/numa_node``), so the pages they fault in are
allocated there (the kernel's default first-touch policy) and the copy
engines read local memory. The mapping asks for huge pages (``MAP_HUGETLB``,
where the system reserved enough) and otherwise marks itself for transparent
huge pages: fewer pages to lock and fewer TLB misses. A failed registration
unregisters every chunk already registered and clears CUDA's sticky error
(``cudaGetLastError``), so the pool stays pageable (slower DMA, still
correct) rather than half pinned, and the next CUDA call does not fail.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

# Bound on one cudaHostRegister call (vLLM uses the same bound against driver
# limits on very large host registrations).
MAX_REGISTER_BYTES = 64 * 1024**3
# Registering threads: the driver serialises part of each call, so more
# than a few stop paying.
MAX_REGISTER_THREADS = 8
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000 if sys.platform == "linux" else 0)
_HUGE_PAGE = 2 * 1024**2


class HostPinError(RuntimeError):
    """cudaHostRegister refused a chunk; everything registered was undone."""


def anonymous_mapping(total: int) -> tuple[mmap.mmap, str]:
    """An anonymous private mapping of at least ``total`` bytes and the kind of
    pages behind it: huge pages where reserved, else transparent ones."""
    if _MAP_HUGETLB and total >= _HUGE_PAGE:
        size = -(-total // _HUGE_PAGE) * _HUGE_PAGE
        try:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
            return mmap.mmap(-1, size, flags=flags), "huge pages (MAP_HUGETLB)"
        except OSError:  # none reserved (vm.nr_hugepages), or too few
            pass
    mapping = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    kind = "4 KiB pages"
    if hasattr(mmap, "MADV_HUGEPAGE") and total >= _HUGE_PAGE:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            kind = "transparent huge pages where the kernel allows"
        except OSError:
            pass
    return mapping, kind


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_numa_cpus(device: torch.device | None, sysfs: str = "/sys") -> tuple[int, set[int]]:
    """(NUMA node, CPUs this process may use on it) of a CUDA device; (-1, empty)
    where unknown (no CUDA device, no sysfs, a single-node machine)."""
    if device is None or device.type != "cuda":
        return -1, set()
    try:
        p = torch.cuda.get_device_properties(device)
        bdf = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"{sysfs}/bus/pci/devices/{bdf}/numa_node") as f:
            node = int(f.read())
        if node < 0:
            return -1, set()
        with open(f"{sysfs}/devices/system/node/node{node}/cpulist") as f:
            cpus = parse_cpulist(f.read())
        return node, cpus & os.sched_getaffinity(0)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return -1, set()


def _code(err) -> int:
    return int(getattr(err, "value", err))


def register_chunks(cudart, base: int, total: int, chunk: int, threads: int = 1,
                    cpus: set[int] | None = None, setup=None) -> list[int]:
    """Registers [base, base + total) in ``chunk``-byte pieces on ``threads``
    threads bound to ``cpus`` (each first calls ``setup``: the CUDA device);
    the registered addresses. On a failure every registered chunk is
    unregistered, CUDA's error cleared, and HostPinError raised."""
    offsets = list(range(0, total, chunk))

    def register(offset: int) -> tuple[int, int]:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only: pages land on the GPU's node
        if setup is not None:
            setup()
        return offset, _code(cudart.cudaHostRegister(base + offset,
                                                     min(chunk, total - offset), 0))

    if threads > 1 and len(offsets) > 1:
        with ThreadPoolExecutor(min(threads, len(offsets)), "kvbm-pin") as pool:
            results = list(pool.map(register, offsets))
    else:
        results = []
        for offset in offsets:  # one at a time: stop at the first refusal
            results.append(register(offset))
            if results[-1][1]:
                break
    done = [base + off for off, code in results if code == 0]
    failed = [(off, code) for off, code in results if code != 0]
    if failed:
        cudart.cudaGetLastError()  # clears the sticky error of the failed call
        unregister(cudart, done)
        off, code = failed[0]
        raise HostPinError(
            f"cudaHostRegister failed (CUDA error {code}) for the host tier at "
            f"{off / 1024**3:.2f} of {total / 1024**3:.2f} GiB; the {len(done)} chunks "
            f"registered were unregistered. Lower host_cache_size or raise the locked-"
            f"memory limit (ulimit -l, the container's memlock)")
    return done


def unregister(cudart, addrs: list[int]) -> None:
    for addr in reversed(sorted(addrs)):
        err = cudart.cudaHostUnregister(addr)
        if _code(err) != 0:
            cudart.cudaGetLastError()
            logger.warning("KVBM: cudaHostUnregister failed (%s)", err)


class HostPool:
    """``cudart``: the CUDA runtime (torch.cuda.cudart() by default; a fake in
    tests). ``device``: the GPU whose NUMA node the pages go to."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool,
                 max_register_bytes: int = MAX_REGISTER_BYTES, cudart=None,
                 device: torch.device | None = None, threads: int = MAX_REGISTER_THREADS):
        total = num_slots * slot_bytes
        self._mapping, self.pages = anonymous_mapping(total)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8,
                                       count=total).view(num_slots, slot_bytes)
        self._registered: list[int] = []
        self._cudart = cudart
        if pin:
            self._pin(slot_bytes, max_register_bytes, device, threads)

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def _pin(self, slot_bytes: int, max_register_bytes: int, device, threads: int) -> None:
        cudart = self._cudart or torch.cuda.cudart()
        base, total = self.tensor.data_ptr(), self.tensor.numel()
        unit = math.lcm(slot_bytes, mmap.PAGESIZE)
        chunk = max(max_register_bytes // unit, 1) * unit
        node, cpus = gpu_numa_cpus(device)
        threads = max(1, min(threads, len(cpus) or os.cpu_count() or 1))
        start = time.perf_counter()
        try:
            self._registered = register_chunks(
                cudart, base, total, chunk, threads, cpus,
                setup=None if self._cudart or device is None else
                lambda: torch.cuda.set_device(device))
        except HostPinError as err:
            logger.warning("KVBM: %s; the host tier stays pageable: transfers stay correct "
                           "but slower", err)
            return
        logger.info("KVBM: host tier pinned: %.2f GiB in %d chunks on %d threads in %.1f s, "
                    "%s, %s", total / 1024**3, len(self._registered), threads,
                    time.perf_counter() - start,
                    f"NUMA node {node}" if node >= 0 else "NUMA node unknown", self.pages)

    def release(self) -> None:
        """Unregisters the pinned ranges. Only once no transfer can touch them."""
        if not self._registered:
            return
        unregister(self._cudart or torch.cuda.cudart(), self._registered)
        self._registered = []
