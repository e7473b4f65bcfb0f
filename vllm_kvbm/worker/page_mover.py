"""Moves whole KV pages between the engine's KV cache and the host pool with NIXL.

Both memories are registered once with one NIXL agent, and a descriptor list
covering every page is prepared once on each side; a transfer is then just a
pair of index lists, posted asynchronously and polled later. The agent
transfers to itself (loopback), which NIXL's UCX backend runs as a memcpy on
CPU and as a DMA copy to or from GPU memory on CUDA.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvbm.config import KVBMConfigError

logger = logging.getLogger(__name__)


def _nixl_api():
    # nixl-cu12 imports as nixl_cu12; the `nixl` meta package may point at
    # another CUDA flavour, so prefer the one this project depends on.
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:  # pragma: no cover - other installs
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


@dataclass(frozen=True)
class PageRegion:
    """One run of equally strided pages: page ``b`` lives at base + b * stride."""

    base: int
    stride: int
    page_bytes: int


def page_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[PageRegion]:
    """Finds where each block's bytes live, for any layout with a block dim.

    vLLM's CPU layout is ``[num_blocks, heads, block_size, 2*head_size]`` per
    layer; CUDA flash-attention layouts put K/V first: ``[2, num_blocks, ...]``.
    Every index over the dims before the block dim is a region whose pages
    (everything after the block dim) must be contiguous.
    """
    regions = []
    for name, t in kv_caches.items():
        dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
        if not dims:
            raise KVBMConfigError(
                f"KV cache of layer {name} has shape {tuple(t.shape)} with no "
                f"dimension of size num_blocks={num_blocks}; this KV layout is unsupported")
        d = dims[0]
        inner = t.shape[d + 1:]
        # The page must be dense; its dims may be permuted (HND layouts view a
        # [.., heads, block_size, ..] page as [.., block_size, heads, ..]).
        expected = 1
        for stride, size in sorted((st, n) for n, st in zip(inner, t.stride()[d + 1:]) if n > 1):
            if stride != expected:
                raise KVBMConfigError(
                    f"KV cache of layer {name}: a block's page is not contiguous "
                    f"(shape {tuple(t.shape)}, stride {t.stride()}); unsupported layout")
            expected *= size
        elem = t.element_size()
        page = math.prod(inner) * elem
        for outer in np.ndindex(*t.shape[:d]):
            offset = sum(i * s for i, s in zip(outer, t.stride()[:d])) * elem
            regions.append(PageRegion(t.data_ptr() + offset, t.stride()[d] * elem, page))
    return regions


class PageMover:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 host_pool: torch.Tensor, backend: str = "UCX", name: str = "kvbm"):
        nixl_agent, nixl_agent_config = _nixl_api()
        self.regions = page_regions(kv_caches, num_blocks)
        self.num_blocks = num_blocks
        self.block_bytes = sum(r.page_bytes for r in self.regions)
        slot_bytes = host_pool.shape[1] * host_pool.element_size()
        if slot_bytes != self.block_bytes:
            raise KVBMConfigError(
                f"host pool slot is {slot_bytes} bytes but one block of the "
                f"registered KV cache is {self.block_bytes}; KV layout mismatch")
        first = next(iter(kv_caches.values()))
        kv_mem = "VRAM" if first.is_cuda else "DRAM"
        kv_dev = first.device.index or 0 if first.is_cuda else 0
        # One UCX worker thread: large posts return at once and the copy runs
        # beside the engine. No progress thread: it spins a whole core idle.
        self.agent = nixl_agent(name, nixl_agent_config(
            backends=[backend], num_threads=1, enable_prog_thread=False))
        self._registered = [
            self.agent.register_memory(self._kv_spans(kv_caches), mem_type=kv_mem),
            self.agent.register_memory(host_pool),
        ]
        nreg = len(self.regions)
        kv_addr = np.array([[r.base + b * r.stride for b in range(num_blocks)]
                            for r in self.regions], dtype=np.uint64).ravel()
        kv_len = np.repeat(np.array([r.page_bytes for r in self.regions], dtype=np.uint64),
                           num_blocks)
        self._kv_side = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._dlist(kv_addr, kv_len, kv_dev), kv_mem)
        num_slots = host_pool.shape[0]
        self.num_slots = num_slots
        offsets = np.cumsum([0] + [r.page_bytes for r in self.regions[:-1]], dtype=np.uint64)
        host_addr = (host_pool.data_ptr()
                     + np.arange(num_slots, dtype=np.uint64)[:, None] * np.uint64(slot_bytes)
                     + offsets[None, :]).ravel()
        host_len = np.tile(np.array([r.page_bytes for r in self.regions], dtype=np.uint64),
                           num_slots)
        self._host_side = self.agent.prep_xfer_dlist(
            self.agent.name, self._dlist(host_addr, host_len, 0), "DRAM")
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
        blocks = np.asarray(block_ids, dtype=np.int64)
        slots_a = np.asarray(slots, dtype=np.int64)
        # NIXL checks descriptor indices, but they are int32 here: an id past
        # 2**31 would wrap onto a valid page and copy the wrong memory.
        if blocks.shape != slots_a.shape or blocks.ndim != 1:
            raise ValueError(f"{len(block_ids)} block ids but {len(slots)} slots")
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise IndexError(f"block ids must be in [0, {self.num_blocks}), got "
                             f"{blocks.min()}..{blocks.max()}")
        if slots_a.size and (slots_a.min() < 0 or slots_a.max() >= self.num_slots):
            raise IndexError(f"host slots must be in [0, {self.num_slots}), got "
                             f"{slots_a.min()}..{slots_a.max()}")
        kv_idx = (self._region_ids[None, :] * self.num_blocks + blocks[:, None]).ravel()
        host_idx = (slots_a[:, None] * self._nreg + self._region_ids[None, :]).ravel()
        return kv_idx.astype(np.int32), host_idx.astype(np.int32)

    def post(self, to_host: bool, block_ids: list[int], slots: list[int]):
        """Starts copying pages; returns a handle for ``poll``. Raises on failure."""
        kv_idx, host_idx = self._indices(block_ids, slots)
        # WRITE pushes local (KV) pages to the "remote" (host pool) side.
        op = "WRITE" if to_host else "READ"
        handle = self.agent.make_prepped_xfer(op, self._kv_side, kv_idx,
                                              self._host_side, host_idx)
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
        """"DONE", "PROC" or "ERR"; a finished handle is released here."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as err:  # a transfer error surfaces as an exception
            logger.warning("KVBM: NIXL transfer failed: %s", err)
            state = "ERR"
        if state != "PROC":
            handle.release()
        return state

    def close(self) -> None:
        for dlist in (self._kv_side, self._host_side):
            dlist.release()
        for reg in self._registered:
            self.agent.deregister_memory(reg)
