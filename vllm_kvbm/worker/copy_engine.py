"""Moves KV pages between GPU memory and the pinned host pool with the GPU's copy engines.

As vLLM's own CPU offloading does (v1/kv_offload/cpu/gpu_worker.py), every
copy of a job is submitted at once on a CUDA stream of the mover's own: with
vLLM's ``swap_blocks_batch`` (one ``cuMemcpyBatchAsync`` on CUDA 12.8+)
where the installed vLLM has it, else PyTorch's ``_foreach_copy_`` over views
of the same bytes. The stream first waits for the compute stream, so a copy
never starts before the kernels queued ahead of it (the forward pass that
wrote a stored block, the zeroing of a loaded one): the same order the
worker's step fence (fence.py) already guarantees, kept exact here. An event
recorded after the copies is queried at each ``poll``; a load is reported
(and the request's attention launched) only once it is done.

NIXL stays the path for disk, remote and host-to-host copies (page_mover.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs, page_copies
from vllm_kvbm.worker.kv_regions import block_regions, checked_ids

logger = logging.getLogger(__name__)


def vllm_swap_blocks_batch():
    """vLLM's batched block copy (``_custom_ops.swap_blocks_batch``), or None
    where this vLLM build has none (the CPU build registers no such op)."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM, or one that fails to import here
        return None
    fn = getattr(ops, "swap_blocks_batch", None)
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 - registered by vLLM's CUDA build
    except (AttributeError, RuntimeError):
        return None
    return fn


class SpanViews:
    """Byte views of registered memory, found by address: what PyTorch's
    copies need where vLLM's pointer-based batch copy is missing."""

    def __init__(self, tensors: list[torch.Tensor]):
        spans = {}
        for t in tensors:
            storage = t.untyped_storage()
            spans[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                storage, 0, (storage.nbytes(),))
        self._bases = np.array(sorted(spans), dtype=np.int64)
        self._views = [spans[int(b)] for b in self._bases]

    def views(self, addrs: np.ndarray, sizes: np.ndarray) -> list[torch.Tensor]:
        idx = np.searchsorted(self._bases, addrs, side="right") - 1
        offs = addrs - self._bases[idx]
        return [self._views[i].narrow(0, o, n)
                for i, o, n in zip(idx.tolist(), offs.tolist(), sizes.tolist())]


class CudaCopies:
    """The copy stream: waits for the compute stream, runs a batch, records an event."""

    def __init__(self, device: torch.device, spans: SpanViews):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._batch = vllm_swap_blocks_batch()
        self._spans = spans
        self.name = ("vLLM swap_blocks_batch" if self._batch is not None
                     else "PyTorch _foreach_copy_")

    def submit(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, to_host: bool):
        """Queues the copies after the compute stream's work; returns
        (event, what must stay alive until it is done)."""
        keep: tuple = ()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self._batch is not None:
                keep = tuple(torch.from_numpy(a) for a in (src, dst, sizes))
                # Host -> GPU reads memory no stream writes: the driver may
                # prefetch it out of order (as vLLM does for loads).
                self._batch(*keep, is_src_access_order_any=not to_host)
            else:
                d, s = self._spans.views(dst, sizes), self._spans.views(src, sizes)
                torch._foreach_copy_(d, s, non_blocking=True)
                keep = (d, s)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event, keep


class _Copy:
    __slots__ = ("event", "keep")

    def __init__(self, event, keep):
        self.event, self.keep = event, keep


class CopyEngineMover:
    """The PageMover interface (post, poll, close) over the copy engines.

    ``copies``: what submits the batches (CudaCopies on the KV cache's
    device by default; a fake one in tests)."""

    path = "copy engine"

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 host_pool: torch.Tensor, block_dims: dict[str, int] | None = None,
                 copies=None, page_blocks: int = 1):
        self.regions = block_regions(kv_caches, num_blocks, block_dims)
        self.table = RegionTable.of(self.regions)
        self.num_blocks = num_blocks
        self.block_bytes = self.table.row_bytes
        slot_bytes = host_pool.shape[1] * host_pool.element_size()
        if slot_bytes != self.block_bytes:
            raise KVBMConfigError(
                f"host pool slot is {slot_bytes} bytes but one block of the "
                f"registered KV cache is {self.block_bytes}; KV layout mismatch")
        self.num_slots = host_pool.shape[0]
        self._host_base = host_pool.data_ptr()
        first = next(iter(kv_caches.values()))
        self.copies = copies or CudaCopies(first.device,
                                           SpanViews([*kv_caches.values(), host_pool]))
        self.path = f"copy engine ({self.copies.name}, a stream of its own)"
        self.page_copies = page_copies(self.table, page_blocks)

    def _runs(self, to_host: bool, block_ids, slots):
        blocks, rows = checked_ids(block_ids, slots, self.num_blocks, self.num_slots)
        return copy_runs(self.table, self._host_base, blocks, rows, to_host)

    def post(self, to_host: bool, block_ids: list[int], slots: list[int]) -> _Copy:
        """Queues the copies of blocks to or from host pool rows; returns a
        handle for ``poll``. Raises on failure (nothing was queued)."""
        src, dst, sizes = self._runs(to_host, block_ids, slots)
        return _Copy(*self.copies.submit(src, dst, sizes, to_host))

    def poll(self, handle: _Copy) -> str:
        """"DONE", "PROC" or "ERR" (a CUDA error the event reports)."""
        try:
            done = handle.event.query()
        except Exception as err:  # noqa: BLE001 - a sticky CUDA error surfaces here
            logger.warning("KVBM: copy-engine transfer failed: %s", err)
            handle.keep = ()
            return "ERR"
        if done:
            handle.keep = ()
            return "DONE"
        return "PROC"

    def close(self) -> None:
        """Only once no transfer is running: nothing is registered."""
        self.copies = None
