"""Moves pages between a KV cache in host memory and the host pool with plain
memory copies, in the posting thread and a few threads of its own.

On vLLM's CPU build both sides are host memory, and one thread copying moves
what one core's memory path allows: NIXL's UCX ``self`` transport is one
``memcpy`` per layer block in the posting thread (page_mover.py), about 9
GB/s here, where two threads on two cores move 12-14 GB/s. So a job's copies
(copy_runs.py: one per layer block, or fewer where both sides continue) are
cut into pieces of at most PIECE_BYTES and, from HELP_BYTES on, shared out:
the posting thread (vLLM's engine thread, between forward passes) takes
pieces one at a time from a shared counter, and so do the helper threads,
woken for each job. The post returns once every piece is copied; a helper
that has no core at the moment costs nothing but its help, since the
posting thread takes every piece no helper has taken, and waits only for
the pieces in flight (a piece is well under a millisecond).
``ctypes.memmove`` releases the GIL while it copies. copy_path.py measures
this path and NIXL's at startup and keeps the faster.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time

import numpy as np
import torch

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.cpus import process_cpus, widen_thread_affinity
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs, page_copies
from vllm_kvbm.worker.kv_regions import block_regions, checked_ids

# A piece of a copy: small enough that the pieces in flight when the posting
# thread runs out of work end at once, large enough that Python's per-piece
# cost (a microsecond) is nothing beside the copy.
PIECE_BYTES = 1 << 20
# Threads copying one job at most (the posting thread included).
MAX_THREADS = 4
# A job under this many bytes is copied by the posting thread alone: waking
# a helper costs about what a few MiB take to copy.
HELP_BYTES = 8 << 20

_memmove = ctypes.memmove


class _Job:
    """One post's pieces, taken by index from a shared counter."""

    __slots__ = ("src", "dst", "sizes", "n", "next", "done")

    def __init__(self, src: list[int], dst: list[int], sizes: list[int]):
        self.src, self.dst, self.sizes, self.n = src, dst, sizes, len(sizes)
        self.next = itertools.count()  # next() is atomic under the GIL
        self.done: list[int] = []  # one entry per piece copied (list.append is atomic)

    def work(self) -> None:
        src, dst, sizes, done = self.src, self.dst, self.sizes, self.done
        i = next(self.next)
        while i < self.n:
            _memmove(dst[i], src[i], sizes[i])
            done.append(i)
            i = next(self.next)


def pieces(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, piece: int
) -> tuple[list[int], list[int], list[int]]:
    """The copies (src, dst, sizes) cut into pieces of at most ``piece`` bytes."""
    counts = np.maximum(1, -(-sizes // piece))
    if int(counts.max(initial=1)) == 1:
        return src.tolist(), dst.tolist(), sizes.tolist()
    which = np.repeat(np.arange(len(sizes)), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    offset = (np.arange(len(which)) - first[which]) * piece
    size = np.minimum(piece, sizes[which] - offset)
    return (src[which] + offset).tolist(), (dst[which] + offset).tolist(), size.tolist()


class HostCopies:
    """A mover (as page_mover.PageMover) for a KV cache in host memory; every
    transfer is done when ``post`` returns."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        host_pool: torch.Tensor,
        block_dims: dict[str, int] | None = None,
        page_blocks: int = 1,
        threads: int | None = None,
    ):
        first = next(iter(kv_caches.values()))
        if first.is_cuda:
            raise ValueError("HostCopies moves host memory only; GPU KV uses copy_engine.py")
        self.regions = block_regions(kv_caches, num_blocks, block_dims)
        self._table = RegionTable.of(self.regions)
        self.num_blocks, self.num_slots = num_blocks, host_pool.shape[0]
        slot_bytes = host_pool.shape[1] * host_pool.element_size()
        if slot_bytes != self._table.row_bytes:
            raise KVBMConfigError(
                f"host pool slot is {slot_bytes} bytes but one block of the "
                f"registered KV cache is {self._table.row_bytes}; KV layout mismatch"
            )
        self.host_base = host_pool.data_ptr()
        self.page_copies = page_copies(self._table, page_blocks)
        if threads is None:
            threads = min(MAX_THREADS, max(1, len(process_cpus())))
        self.threads = threads
        self._queues: list[queue.SimpleQueue] = []
        self._helpers: list[threading.Thread] = []
        for i in range(threads - 1):
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=_helper, args=(q,), name=f"kvbm-copy-{i}", daemon=True)
            t.start()
            self._queues.append(q)
            self._helpers.append(t)
        self.path = f"memory copies in {threads} thread{'s' if threads > 1 else ''}"

    def post(self, to_host: bool, block_ids: list[int], slots: list[int]) -> str:
        """Copies blocks to or from host pool rows; "DONE" once copied.
        Raises (before copying anything) on ids out of range."""
        blocks, rows = checked_ids(block_ids, slots, self.num_blocks, self.num_slots)
        src, dst, sizes = copy_runs(self._table, self.host_base, blocks, rows, to_host)
        job = _Job(*pieces(src, dst, sizes, PIECE_BYTES))
        if job.n > 1 and int(sizes.sum()) >= HELP_BYTES:
            for q in self._queues[: job.n - 1]:
                q.put(job)
        job.work()
        while len(job.done) < job.n:  # pieces a helper is still copying
            time.sleep(0)
        return "DONE"

    def poll(self, handle) -> str:
        """A post's "DONE", or a step of layer-wise stores' state (layer_copies.py)."""
        return handle if isinstance(handle, str) else handle.poll()

    def close(self) -> None:
        """Only once no post is running (posts end before they return)."""
        for q in self._queues:
            q.put(None)
        for t in self._helpers:
            t.join(timeout=5.0)
        self._queues, self._helpers = [], []


def _helper(jobs: queue.SimpleQueue) -> None:
    widen_thread_affinity()  # not the engine thread's core (cpus.py)
    while (job := jobs.get()) is not None:
        job.work()
