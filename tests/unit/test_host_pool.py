"""The host pool's pinning (worker/host_pool.py) with a fake CUDA runtime.

cudaHostRegister needs a GPU: the runtime is a recording fake that can
refuse the Nth chunk and keeps CUDA's sticky-error behaviour (the error a
failed call leaves is returned by the next cudaGetLastError). The mapping,
its huge-page advice, the NUMA lookup from sysfs and the registering
threads are real.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from vllm_kvbm.worker import host_pool
from vllm_kvbm.worker.host_pool import HostPinError, HostPool, parse_cpulist, register_chunks

SLOT = 3 * 4096


class FakeCudart:
    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.calls: list[tuple] = []
        self.registered: set[int] = set()
        self.sticky = 0
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def cudaHostRegister(self, ptr, size, flags):
        with self._lock:
            self.calls.append(("reg", ptr, size, flags))
            self.threads.add(threading.get_ident())
            time.sleep(0.01)  # a register call takes a while: the threads share the chunks
            if len([c for c in self.calls if c[0] == "reg"]) == self.fail_at:
                self.sticky = 2  # cudaErrorMemoryAllocation
                return 2
            self.registered.add(ptr)
            return 0

    def cudaHostUnregister(self, ptr):
        with self._lock:
            self.calls.append(("unreg", ptr))
            self.registered.discard(ptr)
            return 0

    def cudaGetLastError(self):
        err, self.sticky = self.sticky, 0
        return err


def test_pins_in_slot_aligned_chunks_on_several_threads_and_unpins():
    rt = FakeCudart()
    pool = HostPool(10, SLOT, pin=True, max_register_bytes=30000, cudart=rt, threads=4)
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
    pool = HostPool(10, 3000, pin=True, max_register_bytes=7000, cudart=rt)
    assert rt.calls == [("reg", pool.tensor.data_ptr(), 30000, 0)]  # lcm(3000, 4096) > 7000
    pool.release()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_refused_chunk_unregisters_everything_and_clears_the_sticky_error(threads):
    rt = FakeCudart(fail_at=3)
    base, total, chunk = 1 << 30, 10 * SLOT, 2 * SLOT
    with pytest.raises(HostPinError, match=r"CUDA error 2.*unregistered.*ulimit -l"):
        register_chunks(rt, base, total, chunk, threads=threads)
    assert not rt.registered  # nothing stays half pinned
    assert rt.cudaGetLastError() == 0  # the next CUDA call does not inherit the error
    unregs = [c[1] for c in rt.calls if c[0] == "unreg"]
    assert unregs == sorted(unregs, reverse=True) and len(unregs) == (2 if threads == 1 else 4)


def test_a_refused_pool_stays_pageable_with_a_warning(caplog):
    rt = FakeCudart(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.worker.host_pool"):
        pool = HostPool(10, SLOT, pin=True, max_register_bytes=30000, cudart=rt, threads=1)
    assert not pool.pinned and not rt.registered
    assert "stays pageable" in caplog.text and "CUDA error 2" in caplog.text
    pool.tensor[-1].fill_(7)  # still usable memory


def test_pinning_time_and_pages_are_logged(caplog):
    rt = FakeCudart()
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.worker.host_pool"):
        pool = HostPool(1024, 4096, pin=True, max_register_bytes=1 << 20, cudart=rt)
    line = caplog.messages[-1]
    assert "host tier pinned: 0.00 GiB in 4 chunks" in line and " s, NUMA node" in line
    assert "pages" in line
    pool.release()


def test_cpulist_and_numa_node_from_sysfs(tmp_path, monkeypatch):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    torch = pytest.importorskip("torch")

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
