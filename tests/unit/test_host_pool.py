"""The host pool's pinning (worker/host_pool.py) with a fake CUDA runtime.

cudaHostRegister needs a GPU: the runtime is a recording fake that can
refuse the Nth chunk. It keeps what the real one does that matters here:
a refused call leaves an error that the next cudaGetLastError *of the same
thread* returns (the runtime keeps one per host thread), and PyTorch's
binding (``torch.cuda.cudart()``) has exactly the members of
``TORCH_CUDART``, no more: the fake is built from that list, and the list is
checked against torch's own sources. The mapping, its huge-page advice, the
NUMA lookup from sysfs, the registering threads and their CPU affinity are real.
"""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import shutil
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from vllm_kvbm.worker import host_pool
from vllm_kvbm.worker.host_pool import HostPinError, HostPool, parse_cpulist, register_chunks

SLOT = 3 * 4096

# What ``torch.cuda.cudart()`` (torch._C._cudart) has on a CUDA 12 or 13 build:
# torch/csrc/cuda/shared/cudart.cpp, initCudartBindings (cudaOutputMode and
# cudaProfilerInitialize only below CUDA 12). No cudaGetLastError.
TORCH_CUDART = frozenset(
    {
        "cudaError",
        "cudaGetErrorString",
        "cudaProfilerStart",
        "cudaProfilerStop",
        "cudaHostRegister",
        "cudaHostUnregister",
        "cudaStreamCreate",
        "cudaStreamDestroy",
        "cudaMemGetInfo",
    }
)


def _cudart_members_torch_uses() -> set[str]:
    """Every member torch's own Python code takes from its cudart binding:
    ``cudart().X``, ``_cudart.X``, ``cudart = torch.cuda.cudart(); cudart.X``."""
    used = set()
    for path in Path(torch.cuda.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if isinstance(v, ast.Call):
                v = v.func
            name = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", "")
            if name in ("cudart", "_cudart") and node.attr.startswith("cuda"):
                used.add(node.attr)
    return used


def test_the_cudart_list_is_torchs():
    used = _cudart_members_torch_uses()
    # torch's Python code reaches most of the binding; all of it is in the list
    assert (
        {
            "cudaHostRegister",
            "cudaHostUnregister",
            "cudaGetErrorString",
            "cudaError",
            "cudaMemGetInfo",
        }
        <= used
        <= TORCH_CUDART
    ), used
    real = getattr(torch._C, "_cudart", None)  # only on a CUDA build of torch
    if real is not None:
        assert {n for n in dir(real) if not n.startswith("_")} == TORCH_CUDART


def test_host_pool_calls_only_what_torchs_cudart_has():
    """The fake cannot hide a call the real binding lacks: host_pool.py's own
    ``cudart.X`` calls are all members of torch's binding."""
    tree = ast.parse(Path(host_pool.__file__).read_text())
    called = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "cudart"
    }
    assert called and called <= TORCH_CUDART, called - TORCH_CUDART


class CudaError(int):
    """As the binding returns it (a pybind11 enum: ``.value``)."""

    @property
    def value(self) -> int:
        return int(self)


class FakeRuntime:
    """The runtime behind the fake binding: what was registered, on which
    threads, and each thread's last error."""

    def __init__(self, fail_at: int | None = None, fail_unregister: bool = False):
        self.fail_at = fail_at
        self.fail_unregister = fail_unregister
        self.calls: list[tuple] = []
        self.registered: set[int] = set()
        self.threads: set[int] = set()
        self.affinities: list[set[int]] = []
        self.errors: dict[int, int] = {}  # thread -> last error
        self._lock = threading.Lock()

    def register(self, ptr, size, flags):
        with self._lock:
            self.calls.append(("reg", ptr, size, flags))
            self.threads.add(threading.get_ident())
            self.affinities.append(os.sched_getaffinity(0))
            time.sleep(0.01)  # a register call takes a while: the threads share the chunks
            if len([c for c in self.calls if c[0] == "reg"]) == self.fail_at:
                self.errors[threading.get_ident()] = 2  # cudaErrorMemoryAllocation
                return CudaError(2)
            self.registered.add(ptr)
            return CudaError(0)

    def unregister(self, ptr):
        with self._lock:
            self.calls.append(("unreg", ptr))
            if self.fail_unregister:
                self.errors[threading.get_ident()] = 712  # cudaErrorHostMemoryNotRegistered
                return CudaError(712)
            self.registered.discard(ptr)
            return CudaError(0)

    def get_last_error(self) -> int:
        """cudaGetLastError through libcudart: this thread's error, then cleared."""
        return self.errors.pop(threading.get_ident(), 0)

    def cudart(self):
        """A binding with exactly torch's members."""

        def unused(name):
            def call(*args):
                raise AssertionError(f"host_pool called {name}")

            return call

        impl = {"cudaHostRegister": self.register, "cudaHostUnregister": self.unregister}
        return types.SimpleNamespace(**{n: impl.get(n) or unused(n) for n in TORCH_CUDART})

    def pool(self, *args, **kwargs) -> HostPool:
        return HostPool(
            *args, pin=True, cudart=self.cudart(), clear_error=self.get_last_error, **kwargs
        )


def test_the_fake_binding_has_exactly_torchs_members():
    fake = FakeRuntime().cudart()
    assert {n for n in dir(fake) if not n.startswith("_")} == TORCH_CUDART
    assert not hasattr(fake, "cudaGetLastError")


def test_pins_in_slot_aligned_chunks_on_several_threads_and_unpins():
    rt = FakeRuntime()
    pool = rt.pool(10, SLOT, max_register_bytes=30000, threads=4)
    base = pool.tensor.data_ptr()
    assert base % 4096 == 0 and pool.tensor.untyped_storage().nbytes() == 10 * SLOT
    # 2 slots (24576 bytes) per registration: chunks end on slot and page boundaries
    assert sorted(rt.calls) == [("reg", base + i * 2 * SLOT, 2 * SLOT, 0) for i in range(5)]
    assert pool.pinned and len(rt.threads) > 1 and threading.get_ident() not in rt.threads
    rt.calls.clear()
    pool.release()
    assert sorted(rt.calls) == sorted(("unreg", base + i * 2 * SLOT) for i in range(5))
    pool.release()  # once only
    assert len(rt.calls) == 5 and not rt.registered
    # slots that are not whole pages: a chunk is a whole number of both
    rt.calls.clear()
    pool = rt.pool(10, 3000, max_register_bytes=7000)
    assert rt.calls == [("reg", pool.tensor.data_ptr(), 30000, 0)]  # lcm(3000, 4096) > 7000
    pool.release()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_refused_chunk_unregisters_everything_and_clears_the_error_where_it_was_made(threads):
    rt = FakeRuntime(fail_at=3)
    base, total, chunk = 1 << 30, 10 * SLOT, 2 * SLOT
    with pytest.raises(HostPinError, match=r"CUDA error 2.*unregistered.*ulimit -l"):
        register_chunks(
            rt.cudart(), base, total, chunk, threads=threads, clear_error=rt.get_last_error
        )
    assert not rt.registered  # nothing stays half pinned
    # the refusing thread's error was cleared on that thread; the caller never had one
    assert rt.errors == {} and threading.get_ident() not in rt.threads
    regs = [c[1] for c in rt.calls if c[0] == "reg"]
    unregs = [c[1] for c in rt.calls if c[0] == "unreg"]
    assert unregs == sorted(unregs, reverse=True) and len(unregs) == len(regs) - 1
    if threads == 1:  # one at a time: nothing is tried after the refusal
        assert len(regs) == 3


def test_a_thread_that_raises_is_undone_as_a_refusal():
    rt = FakeRuntime()
    calls = iter(range(100))

    def setup():  # the CUDA device of the third thread to start fails to be set
        if next(calls) == 2:
            raise RuntimeError("CUDA error: invalid device ordinal")

    with pytest.raises(HostPinError, match="RuntimeError: CUDA error: invalid device ordinal"):
        register_chunks(
            rt.cudart(),
            1 << 30,
            10 * SLOT,
            2 * SLOT,
            threads=1,
            setup=setup,
            clear_error=rt.get_last_error,
        )
    assert not rt.registered and len([c for c in rt.calls if c[0] == "reg"]) == 2


def test_registration_never_moves_the_callers_cpus():
    """A pool of one chunk used to be registered on the caller's thread after
    sched_setaffinity: vLLM's engine thread stayed on the GPU's NUMA CPUs."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one CPU: an affinity change would not show")
    node = {min(mine)}
    rt = FakeRuntime()
    try:
        done = register_chunks(
            rt.cudart(), 1 << 30, SLOT, SLOT, threads=1, cpus=node, clear_error=rt.get_last_error
        )
        assert os.sched_getaffinity(0) == mine
    finally:
        os.sched_setaffinity(0, mine)
    assert done == [1 << 30] and rt.affinities == [node]  # the helper ran on the node
    assert threading.get_ident() not in rt.threads


def test_a_refused_pool_stays_pageable_with_a_warning(caplog):
    rt = FakeRuntime(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.worker.host_pool"):
        pool = rt.pool(10, SLOT, max_register_bytes=30000, threads=1)
    assert not pool.pinned and not rt.registered and rt.errors == {}
    assert "stays pageable" in caplog.text and "CUDA error 2" in caplog.text
    pool.tensor[-1].fill_(7)  # still usable memory


def test_a_refused_unregister_clears_the_callers_error(caplog):
    rt = FakeRuntime()
    pool = rt.pool(4, SLOT, max_register_bytes=2 * SLOT)
    rt.fail_unregister = True
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.worker.host_pool"):
        pool.release()
    assert "cudaHostUnregister failed" in caplog.text
    assert rt.errors == {}  # the engine thread's next CUDA call does not inherit it


def test_pinning_time_and_pages_are_logged(caplog):
    rt = FakeRuntime()
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.worker.host_pool"):
        pool = rt.pool(1024, 4096, max_register_bytes=1 << 20)
    line = caplog.messages[-1]
    assert "host tier pinned: 0.00 GiB in 4 chunks" in line and " s, NUMA node" in line
    assert "pages" in line
    pool.release()


FAKE_LIBCUDART = r"""
static int last = 0;
void kvbm_test_fail(int code) { last = code; }
int cudaGetLastError(void) { int r = last; last = 0; return r; }
"""


def test_the_error_is_cleared_through_the_libcudart_torch_loaded(tmp_path):
    """cudaGetLastError is called in the libcudart already in the process
    (found in /proc/self/maps), never a second copy: a C library standing in
    for it, loaded first, is the one cleared."""
    assert host_pool.loaded_library("libcudart", str(tmp_path / "none")) is None
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f01-7f02 r-xp 00000000 08:01 2 /opt/nvidia/cuda_runtime/lib/"
        "libcudart.so.12\n7f02-7f03 rw-p 00000000 00:00 0 \n"
    )
    assert host_pool.loaded_library("libcudart", str(maps)) == (
        "/opt/nvidia/cuda_runtime/lib/libcudart.so.12"
    )
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the stand-in libcudart")
    src, lib = tmp_path / "cudart.c", tmp_path / "libcudart.so.13"
    src.write_text(FAKE_LIBCUDART)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    loaded = ctypes.CDLL(str(lib))  # as PyTorch's CUDA build loads it
    maps.write_text(f"7f01-7f02 r-xp 00000000 08:01 2 {lib}\n")
    get_last_error = host_pool.runtime_get_last_error(str(maps))
    loaded.kvbm_test_fail(2)
    assert get_last_error() == 2  # the error the loaded copy holds
    assert get_last_error() == 0  # cleared
    assert host_pool.runtime_get_last_error(str(tmp_path / "none")) is None


def test_cpulist_and_numa_node_from_sysfs(tmp_path, monkeypatch):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}

    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1B, 0

    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    mine = sorted(os.sched_getaffinity(0))
    (node / "cpulist").write_text(f"{mine[0]}-{mine[0]},100000\n")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    got = host_pool.gpu_numa_cpus(torch.device("cuda", 0), sysfs=str(tmp_path))
    assert got == (1, {mine[0]})  # CPUs outside this process's set are left out
    (dev / "numa_node").write_text("-1\n")  # a single-node machine
    assert host_pool.gpu_numa_cpus(torch.device("cuda", 0), sysfs=str(tmp_path)) == (-1, set())
    assert host_pool.gpu_numa_cpus(torch.device("cpu")) == (-1, set())


def _resident_bytes(addr: int) -> int:
    """Rss of the mapping that starts at ``addr`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if all(c in "0123456789abcdef" for c in start) and int(start, 16) == addr:
            rss = next(entry for entry in lines[i + 1 :] if entry.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.mark.parametrize("kernel", ["populate_write", "before 5.14"])
def test_a_pool_that_is_not_pinned_is_resident_before_the_first_store(kernel, monkeypatch, caplog):
    """Left to the first store into each slot, faulting the pages in ran on the
    engine's thread inside its step. A kernel without MADV_POPULATE_WRITE
    (EINVAL, made here with an advice no kernel knows) gets a write per page."""
    if kernel != "populate_write":
        monkeypatch.setattr(host_pool, "_MADV_POPULATE_WRITE", 0x7FFF)
    slots, slot_bytes = 24, 3 * 1024**2 + 4096  # not a multiple of a huge page
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.worker.host_pool"):
        pool = HostPool(slots, slot_bytes, pin=False)
    addr = pool.tensor.data_ptr()
    assert _resident_bytes(addr) >= slots * slot_bytes
    how = "MADV_POPULATE_WRITE" if kernel == "populate_write" else "a write per page"
    assert "host tier populated: 0.07 GiB in" in caplog.text and how in caplog.text
    assert int(pool.tensor.sum()) == 0  # still the kernel's zeros


def test_a_pool_larger_than_the_memory_available_is_refused_naming_the_key(monkeypatch):
    """Populated at startup, a pool past MemAvailable would have the kernel kill
    the engine (a fault not made for real here: the machine's memory)."""
    monkeypatch.setattr(host_pool, "available_memory", lambda: 32 * 1024**2)
    from vllm_kvbm.config import KVBMConfigError

    with pytest.raises(KVBMConfigError) as err:
        HostPool(24, 2 * 1024**2, pin=False)
    msg = str(err.value)
    assert msg.startswith(
        "host_cache_size: the host tier needs 0.05 GiB on this worker and "
        "0.03 GiB of memory is available"
    ), msg
    assert "lower host_cache_size" in msg
    assert host_pool.available_memory() > 0  # the real one reads /proc/meminfo
