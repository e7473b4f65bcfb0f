"""Moves whole KV pages between the engine's KV cache and the host pool with NIXL.

A page is a run of vLLM blocks, and a vLLM block is one *layer block* per
layer (and per K and V where they are apart): what the descriptors here
name. Both memories are registered once with one NIXL agent, and a
descriptor list covering every layer block is prepared once on each side
(engine blocks, host pool rows); a transfer is then just a
pair of index lists, posted asynchronously and polled later. The agent
transfers to itself (loopback): a DMA copy to or from GPU memory on CUDA.

KV cache in host memory (vLLM on CPU): left to choose, UCX moves a loopback
RMA through the kernel's cross-memory attach (cma: process_vm_readv/writev,
slower than a memcpy: docs/benchmarks.md); its shared-memory transports
(posix, sysv) only reach memory UCX allocated itself, and its ``self``
transport, which copies a PUT with one plain memcpy straight into the target,
has no GET (a READ falls back to active-message emulation) and refuses NIXL's
default peer-failure error handling. So on CPU the agent's UCX context is
limited to ``self`` with error handling off, and both directions are WRITEs:
a load writes the host pool's pages into the KV cache. A ``self`` PUT
completes inside the call that posts it: by default on the engine thread,
where the forward pass has already finished (CPU runs it synchronously), so a
transfer is done when ``post`` returns and reported in the same step.
``copy_thread=True`` posts from a thread of the mover's own instead; with few
cores it costs more than it hides (docs/benchmarks.md), so it is not the
default.
"""

from __future__ import annotations

import importlib
import logging
import queue
import time

import numpy as np
import torch

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.cpus import widened_thread

# Re-exported: where callers have always found them.
from vllm_kvbm.worker.kv_regions import (  # noqa: F401
    BlockRegion,
    block_dim_of,
    block_regions,
    block_view,
    checked_ids,
)
from vllm_kvbm.nixl_api import (  # noqa: F401
    NixlBuildError,
    _nixl_api,
    load_nixl,
    nixl_builds_for,
)

logger = logging.getLogger(__name__)


# UCX backend parameters for an agent that copies host memory to itself:
# only the self transport (a PUT is one memcpy into the target), which does
# not support peer-failure handling (there is no peer). UCX_TLS in the
# environment still wins (NIXL applies engine_config only to unset keys).
HOST_LOOPBACK_PARAMS = {"engine_config": "TLS=self", "ucx_error_handling_mode": "none"}


# How long polling an unfinished load hands the GIL to the copy thread.
_YIELD_S = 0.00005


class _HostCopy:
    """A transfer handed to the copy thread; ``state`` is PROC until it ran."""

    __slots__ = ("handle", "is_load", "state")

    def __init__(self, handle, is_load: bool):
        self.handle = handle
        self.is_load = is_load
        self.state = "PROC"


class _CopyThread:
    """Posts host-memory transfers to NIXL one after another, off the engine thread.

    The caller makes and releases the transfer handles; this thread only posts
    them (and, were a post ever to return PROC, polls it): one NIXL call that
    copies with the GIL released, so each transfer takes the GIL here twice
    (waking up, and after the copy), not once per NIXL call. The agent is
    created with NIXL's RW locking, under which making, posting and releasing
    handles may run on different threads at once.
    """

    def __init__(self, agent, name: str):
        self._agent = agent
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Widened: vLLM binds the engine thread to its OpenMP cores and a
        # thread inherits its creator's binding, so the copies would take
        # turns with the forward pass while the cores vLLM reserved idle.
        self._thread = widened_thread(self._run, f"{name}-copy")
        self._thread.start()

    def submit(self, handle, is_load: bool) -> _HostCopy:
        job = _HostCopy(handle, is_load)
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                state = self._agent.transfer(job.handle)
                while state == "PROC":
                    state = self._agent.check_xfer_state(job.handle)
            except Exception as err:  # a transfer error surfaces as an exception
                logger.warning("KVBM: NIXL transfer failed: %s", err)
                state = "ERR"
            job.state = state

    def stop(self) -> None:
        """Returns once every transfer submitted before it has run."""
        self._queue.put(None)
        self._thread.join()


class PageMover:
    """``loopback``: for a KV cache in host memory, "self" (the default; see
    the module docstring) or "default" (UCX's own transport choice, loads as
    READs, as with GPU memory; kept to compare against in benchmarks/bench_host_tier.py).
    ``copy_thread``: with "self", post from a thread of the mover's own
    rather than copy inside ``post``. A KV cache in GPU memory always uses
    UCX's own choice."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        host_pool: torch.Tensor,
        backend: str = "UCX",
        name: str = "kvbm",
        block_dims: dict[str, int] | None = None,
        loopback: str = "self",
        copy_thread: bool = False,
    ):
        if loopback not in ("self", "default"):
            raise ValueError(f"loopback must be 'self' or 'default', not {loopback!r}")
        nixl_agent, nixl_agent_config, self.nixl_module = _nixl_api()
        self.regions = block_regions(kv_caches, num_blocks, block_dims)
        self.num_blocks = num_blocks
        self.block_bytes = sum(r.layer_block_bytes for r in self.regions)
        slot_bytes = host_pool.shape[1] * host_pool.element_size()
        if slot_bytes != self.block_bytes:
            raise KVBMConfigError(
                f"host pool slot is {slot_bytes} bytes but one block of the "
                f"registered KV cache is {self.block_bytes}; KV layout mismatch"
            )
        first = next(iter(kv_caches.values()))
        kv_mem = "VRAM" if first.is_cuda else "DRAM"
        kv_dev = first.device.index or 0 if first.is_cuda else 0
        host_only = kv_mem == "DRAM" and backend == "UCX" and loopback == "self"
        if host_only:
            sync = importlib.import_module(f"{self.nixl_module}._api").nixl_thread_sync_t
            self.agent = nixl_agent(
                name,
                nixl_agent_config(
                    backends=[],
                    enable_prog_thread=False,
                    sync_mode=sync.NIXL_THREAD_SYNC_RW if copy_thread else None,
                ),
            )
            self.agent.create_backend(backend, dict(HOST_LOOPBACK_PARAMS))
        else:
            # One UCX worker thread: large posts return at once and the copy
            # runs beside the engine. No progress thread: it spins a whole core idle.
            self.agent = nixl_agent(
                name, nixl_agent_config(backends=[backend], num_threads=1, enable_prog_thread=False)
            )
        self._registered = [
            self.agent.register_memory(self._kv_spans(kv_caches), mem_type=kv_mem),
            self.agent.register_memory(host_pool),
        ]
        nreg = len(self.regions)
        kv_addr = np.array(
            [[r.base + b * r.stride for b in range(num_blocks)] for r in self.regions],
            dtype=np.uint64,
        ).ravel()
        kv_len = np.repeat(
            np.array([r.layer_block_bytes for r in self.regions], dtype=np.uint64), num_blocks
        )
        kv_rows = self._dlist(kv_addr, kv_len, kv_dev)
        self._kv_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", kv_rows, kv_mem)
        num_slots = host_pool.shape[0]
        self.num_slots = num_slots
        offsets = np.cumsum([0] + [r.layer_block_bytes for r in self.regions[:-1]], dtype=np.uint64)
        host_addr = (
            host_pool.data_ptr()
            + np.arange(num_slots, dtype=np.uint64)[:, None] * np.uint64(slot_bytes)
            + offsets[None, :]
        ).ravel()
        host_len = np.tile(
            np.array([r.layer_block_bytes for r in self.regions], dtype=np.uint64), num_slots
        )
        host_rows = self._dlist(host_addr, host_len, 0)
        self._host_side = self.agent.prep_xfer_dlist(self.agent.name, host_rows, "DRAM")
        self._dlists = [self._kv_side, self._host_side]
        self._copier: _CopyThread | None = None
        if host_only:
            # Loads are WRITEs too: the host pool as the local side, the KV
            # cache as the target.
            self._host_src = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", host_rows, "DRAM")
            self._kv_dst = self.agent.prep_xfer_dlist(self.agent.name, kv_rows, kv_mem)
            self._dlists += [self._host_src, self._kv_dst]
            if copy_thread:
                self._copier = _CopyThread(self.agent, name)
        self._loads_as_writes = host_only
        self.path = f"NIXL ({self.nixl_module}, {backend}{' self transport' if host_only else ''})"
        self._nreg = nreg
        self._region_ids = np.arange(nreg, dtype=np.int64)

    @staticmethod
    def _kv_spans(kv_caches: dict[str, torch.Tensor]) -> list[tuple[int, int, int, str]]:
        """Registration list: the distinct memory spans behind the layer views."""
        spans: dict[int, int] = {}
        for t in kv_caches.values():
            storage = t.untyped_storage()
            spans[storage.data_ptr()] = storage.nbytes()
        dev = 0
        first = next(iter(kv_caches.values()))
        if first.is_cuda:
            dev = first.device.index or 0
        return [(ptr, nbytes, dev, "") for ptr, nbytes in sorted(spans.items())]

    @staticmethod
    def _dlist(addrs: np.ndarray, lens: np.ndarray, dev: int) -> np.ndarray:
        return np.stack([addrs, lens, np.full_like(addrs, dev)], 1).astype(np.uint64)

    def _indices(self, block_ids: list[int], slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        # NIXL checks descriptor indices, but they are int32 here: an id past
        # 2**31 would wrap onto a valid layer block and copy the wrong memory.
        blocks, slots_a = checked_ids(block_ids, slots, self.num_blocks, self.num_slots)
        kv_idx = (self._region_ids[None, :] * self.num_blocks + blocks[:, None]).ravel()
        host_idx = (slots_a[:, None] * self._nreg + self._region_ids[None, :]).ravel()
        return kv_idx.astype(np.int32), host_idx.astype(np.int32)

    def post(self, to_host: bool, block_ids: list[int], slots: list[int]):
        """Starts copying blocks to or from host pool rows; returns a handle for
        ``poll``. Raises on failure."""
        kv_idx, host_idx = self._indices(block_ids, slots)
        if to_host:
            # WRITE pushes local (KV) layer blocks to the "remote" (host pool) side.
            handle = self.agent.make_prepped_xfer(
                "WRITE", self._kv_side, kv_idx, self._host_side, host_idx
            )
        elif self._loads_as_writes:
            handle = self.agent.make_prepped_xfer(
                "WRITE", self._host_src, host_idx, self._kv_dst, kv_idx
            )
        else:
            handle = self.agent.make_prepped_xfer(
                "READ", self._kv_side, kv_idx, self._host_side, host_idx
            )
        if self._copier is not None:
            return self._copier.submit(handle, not to_host)
        try:
            state = self.agent.transfer(handle)
        except Exception:
            handle.release()
            raise
        if state == "ERR":
            handle.release()
            raise RuntimeError("NIXL refused the transfer")
        return handle

    def poll(self, handle) -> str:
        """ "DONE", "PROC" or "ERR"; a finished handle is released here."""
        if isinstance(handle, _HostCopy):
            state = handle.state
            if state != "PROC":
                handle.handle.release()
            elif handle.is_load:
                # A request waits for this copy, and vLLM's engine loop, which
                # polls it every step, runs Python almost without pause: left
                # alone, the copy thread would get the GIL to start, and again
                # to report, only when CPython forces a switch (every 5 ms).
                time.sleep(_YIELD_S)
            return state
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as err:  # a transfer error surfaces as an exception
            logger.warning("KVBM: NIXL transfer failed: %s", err)
            state = "ERR"
        if state != "PROC":
            handle.release()
        return state

    def close(self) -> None:
        """Only once no transfer is running (the copy thread ends after its queue)."""
        if self._copier is not None:
            self._copier.stop()
            self._copier = None
        for dlist in self._dlists:
            dlist.release()
        for reg in self._registered:
            self.agent.deregister_memory(reg)
