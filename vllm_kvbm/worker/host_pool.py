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
engines read local memory. Registration always runs on those helper
threads, never the caller's (vLLM's engine thread keeps its CPUs). The
mapping asks for huge pages (``MAP_HUGETLB``, where the system reserved
enough) and otherwise marks itself for transparent huge pages: fewer pages to
lock and fewer TLB misses.

A pool that is not pinned (vLLM's CPU build, or a refused registration) is
populated instead, at startup, on helper threads: every page faulted in with
``MADV_POPULATE_WRITE`` (or one write per page where the kernel predates it).
Left to be faulted in by the first store into each slot, the kernel's zeroing
and page-table work ran inside the engine's step, on its thread: a first
touch of fresh memory copied at a tenth of a warm copy's speed or less
(0.8 against 10 GB/s on a 2-core VM; docs/benchmarks.md), and every store
into a slot not yet used (the first host-tier-full of traffic) slowed the
miss that made it.

A failed registration unregisters every chunk already registered, so the pool
stays pageable (slower DMA, still correct) rather than half pinned. The
failed call also leaves its error as the CUDA runtime's last error *of that
thread*, which PyTorch's next kernel-launch check on the thread would raise;
it is cleared there with ``cudaGetLastError``. PyTorch's runtime binding
(``torch.cuda.cudart()``) has no such function, so it is called through
ctypes in the libcudart PyTorch already loaded (as vLLM's own host
registration does, through its ``CudaRTLibrary``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

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


def loaded_library(prefix: str, maps: str = "/proc/self/maps") -> str | None:
    """Path of the first library named ``prefix``* mapped into this process."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(prefix) and ".so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def runtime_get_last_error(maps: str = "/proc/self/maps") -> Callable[[], int] | None:
    """``cudaGetLastError`` of the libcudart already loaded (PyTorch's), or None.

    Never a second copy loaded from elsewhere: a runtime of its own would
    clear its own error, not PyTorch's."""
    path = loaded_library("libcudart", maps)
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).cudaGetLastError
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


def clear_last_error() -> int | None:
    """Clears the calling thread's last CUDA runtime error; its code, or None
    where no loaded libcudart was found (then it is said once)."""
    fn = runtime_get_last_error()
    if fn is None:
        if not _said_no_runtime.is_set():
            _said_no_runtime.set()
            logger.warning(
                "KVBM: no libcudart loaded in this process (PyTorch without CUDA, "
                "or linked statically): a refused cudaHostRegister's error cannot "
                "be cleared; the next CUDA call on its thread may report it"
            )
        return None
    return fn()


_said_no_runtime = threading.Event()


def register_chunks(
    cudart,
    base: int,
    total: int,
    chunk: int,
    threads: int = 1,
    cpus: set[int] | None = None,
    setup=None,
    clear_error: Callable[[], int | None] = clear_last_error,
) -> list[int]:
    """Registers [base, base + total) in ``chunk``-byte pieces on ``threads``
    helper threads bound to ``cpus`` (each first calls ``setup``: the CUDA
    device); the registered addresses. The caller's thread registers nothing:
    its CPU affinity and its CUDA error state stay as they were. After a
    refusal no further chunk is tried; every registered chunk is then
    unregistered and HostPinError raised."""
    offsets = list(range(0, total, chunk))
    refused = threading.Event()
    raised: list[Exception] = []

    def register(offset: int) -> tuple[int, int | None]:
        if refused.is_set():
            return offset, None  # not tried
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)  # this thread only: pages land on the GPU's node
            if setup is not None:
                setup()
            code = _code(cudart.cudaHostRegister(base + offset, min(chunk, total - offset), 0))
        except Exception as err:  # noqa: BLE001 - undone below as a refusal is
            raised.append(err)
            refused.set()
            return offset, -1
        if code:
            refused.set()
            clear_error()  # the error is this thread's: cleared here
        return offset, code

    with ThreadPoolExecutor(max(1, min(threads, len(offsets))), "kvbm-pin") as pool:
        results = list(pool.map(register, offsets))  # one thread: in order, one at a time
    done = [base + off for off, code in results if code == 0]
    failed = [(off, code) for off, code in results if code]
    if failed:
        unregister(cudart, done, clear_error)
        off, code = failed[0]
        why = f"{type(raised[0]).__name__}: {raised[0]}" if code == -1 else f"CUDA error {code}"
        raise HostPinError(
            f"cudaHostRegister failed ({why}) for the host tier at "
            f"{off / 1024**3:.2f} of {total / 1024**3:.2f} GiB; the {len(done)} chunks "
            f"registered were unregistered. Lower host_cache_size or raise the locked-"
            f"memory limit (ulimit -l, the container's memlock)"
        )
    return done


def unregister(
    cudart, addrs: list[int], clear_error: Callable[[], int | None] = clear_last_error
) -> None:
    for addr in reversed(sorted(addrs)):
        err = cudart.cudaHostUnregister(addr)
        if _code(err) != 0:
            clear_error()  # this thread's (the caller's): its next CUDA call must not see it
            logger.warning("KVBM: cudaHostUnregister failed (CUDA error %d)", _code(err))


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def populate(base: int, total: int, chunk: int = 256 * 1024**2, threads: int = 2) -> str:
    """Faults in every page of [base, base + total) on ``threads`` helper
    threads (the caller's thread keeps its CPU binding); how it was done."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    step = mmap.PAGESIZE
    how = ["MADV_POPULATE_WRITE"]

    def one(offset: int) -> None:
        size = min(chunk, total - offset)
        if (
            how[0] == "MADV_POPULATE_WRITE"
            and madvise(base + offset, size, _MADV_POPULATE_WRITE) == 0
        ):
            return
        how[0] = "a write per page"  # EINVAL: a kernel before 5.14
        view = (ctypes.c_char * size).from_address(base + offset)
        for i in range(0, size, step):
            view[i] = view[i]

    with ThreadPoolExecutor(max(1, min(threads, -(-total // chunk))), "kvbm-populate") as pool:
        list(pool.map(one, range(0, total, chunk)))
    return how[0]


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes; None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class HostPool:
    """``cudart``: PyTorch's CUDA runtime binding (torch.cuda.cudart() by
    default) and ``clear_error`` the runtime's cudaGetLastError (through
    libcudart by default): fakes in tests. ``device``: the GPU whose NUMA
    node the pages go to."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        pin: bool,
        max_register_bytes: int = MAX_REGISTER_BYTES,
        cudart=None,
        device: torch.device | None = None,
        threads: int = MAX_REGISTER_THREADS,
        clear_error: Callable[[], int | None] = clear_last_error,
    ):
        total = num_slots * slot_bytes
        self._mapping, self.pages = anonymous_mapping(total)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8, count=total).view(
            num_slots, slot_bytes
        )
        self._registered: list[int] = []
        self._cudart = cudart
        self._clear_error = clear_error
        if pin:
            self._pin(slot_bytes, max_register_bytes, device, threads)
        if not self._registered and total:
            free = available_memory()
            if free is not None and total > free:
                from vllm_kvbm.config import KVBMConfigError

                raise KVBMConfigError(
                    f"host_cache_size: the host tier needs {total / 1024**3:.2f} GiB on this "
                    f"worker and {free / 1024**3:.2f} GiB of memory is available "
                    f"(MemAvailable); lower host_cache_size (or host_cache_blocks), or free "
                    f"memory: populating it would have the kernel kill the engine"
                )
            start = time.perf_counter()
            how = populate(
                self.tensor.data_ptr(), total, threads=max(1, min(threads, os.cpu_count() or 1))
            )
            took = time.perf_counter() - start
            logger.info(
                "KVBM: host tier populated: %.2f GiB in %.1f s (%.1f GB/s, %s), %s",
                total / 1024**3,
                took,
                total / max(took, 1e-9) / 1e9,
                how,
                self.pages,
            )

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
                cudart,
                base,
                total,
                chunk,
                threads,
                cpus,
                setup=None
                if self._cudart or device is None
                else lambda: torch.cuda.set_device(device),
                clear_error=self._clear_error,
            )
        except HostPinError as err:
            logger.warning(
                "KVBM: %s; the host tier stays pageable: transfers stay correct but slower", err
            )
            return
        logger.info(
            "KVBM: host tier pinned: %.2f GiB in %d chunks on %d threads in %.1f s, %s, %s",
            total / 1024**3,
            len(self._registered),
            threads,
            time.perf_counter() - start,
            f"NUMA node {node}" if node >= 0 else "NUMA node unknown",
            self.pages,
        )

    def release(self) -> None:
        """Unregisters the pinned ranges. Only once no transfer can touch them."""
        if not self._registered:
            return
        unregister(self._cudart or torch.cuda.cudart(), self._registered, self._clear_error)
        self._registered = []
