"""Moves KV pages between GPU memory and the pinned host pool with the GPU's copy engines.

As vLLM's own CPU offloading does (v1/kv_offload/cpu/gpu_worker.py), every
copy of a job is submitted at once on a CUDA stream of the mover's own: with
vLLM's ``swap_blocks_batch`` (one ``cuMemcpyBatchAsync`` on CUDA 12.8+)
where the installed vLLM has it, else PyTorch's ``_foreach_copy_`` over views
of the same bytes (one ``cudaMemcpyAsync`` per copy: a warning says so once).
Stores and loads have a stream each, so a load never queues behind a store.

Order, on the GPU, not by the host: the worker posts a step's jobs when the
connector is called, with the step's fence (fence.py: an event recorded on
vLLM's current stream at that call), and the copy stream waits for that
event (``wait_event``). So a store never reads a block before the forward
pass launched ahead of ``wait_for_save`` wrote it, and a load never lands
before the kernels queued ahead of ``start_load_kv`` on its blocks (the
zeroing of new blocks, a step still running for their last owner); nothing
queued after the call delays the copy. A post without a fence (the startup
round trip, a fetched load whose fence is gone) waits for everything queued
on the engine's stream so far (``wait_stream``). An event recorded after the
copies is queried at each ``poll``; a load is reported (and the request's
attention launched) only once it is done.

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

_warned: set[str] = set()


def vllm_swap_blocks_batch():
    """(vLLM's batched block copy ``_custom_ops.swap_blocks_batch``, "") or
    (None, which part of it this vLLM lacks)."""
    try:
        from vllm import _custom_ops as ops
    except Exception as err:  # noqa: BLE001 - no vLLM, or one that fails to import here
        return None, f"vllm._custom_ops does not import ({type(err).__name__}: {err})"
    fn = getattr(ops, "swap_blocks_batch", None)
    if fn is None:
        return None, "vllm._custom_ops has no swap_blocks_batch (the Python wrapper)"
    try:
        torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018 - registered by vLLM's CUDA build
    except (AttributeError, RuntimeError):
        return None, (
            "torch.ops._C_cache_ops.swap_blocks_batch is not registered (vLLM's "
            "CUDA build registers it)"
        )
    return fn, ""


class SpanViews:
    """Byte views of registered memory, found by address: what PyTorch's
    copies need where vLLM's pointer-based batch copy is missing."""

    def __init__(self, tensors: list[torch.Tensor]):
        spans = {}
        for t in tensors:
            storage = t.untyped_storage()
            spans[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                storage, 0, (storage.nbytes(),)
            )
        self._bases = np.array(sorted(spans), dtype=np.int64)
        self._views = [spans[int(b)] for b in self._bases]

    def views(self, addrs: np.ndarray, sizes: np.ndarray) -> list[torch.Tensor]:
        idx = np.searchsorted(self._bases, addrs, side="right") - 1
        offs = addrs - self._bases[idx]
        return [
            self._views[i].narrow(0, o, n)
            for i, o, n in zip(idx.tolist(), offs.tolist(), sizes.tolist())
        ]


class CopyHandle:
    """A posted job: the event recorded after its copies, what must stay
    alive until it is done, and (timed) an event recorded before them."""

    __slots__ = ("event", "keep", "start")

    def __init__(self, event, keep, start=None):
        self.event, self.keep, self.start = event, keep, start

    def seconds(self) -> float | None:
        """The copies' time on the GPU, once done; None unless timed."""
        if self.start is None:
            return None
        return self.start.elapsed_time(self.event) / 1e3


class CudaCopies:
    """The copy streams (stores, loads): each batch waits for the engine's
    stream (the fence's event), runs, and records an event.

    ``cuda``: torch.cuda's stream and event API; ``find_batch`` what finds
    vLLM's batch copy; ``foreach_copy`` PyTorch's: fakes in tests."""

    def __init__(
        self,
        device: torch.device,
        spans: SpanViews,
        cuda=torch.cuda,
        find_batch=vllm_swap_blocks_batch,
        foreach_copy=torch._foreach_copy_,
    ):
        self.device = device
        self._cuda = cuda
        self.streams = {True: cuda.Stream(device), False: cuda.Stream(device)}
        self._batch, self.missing = find_batch()
        self._foreach_copy = foreach_copy
        self._spans = spans
        self.name = (
            "vLLM swap_blocks_batch" if self._batch is not None else "PyTorch _foreach_copy_"
        )

    def order(self, stream, after) -> None:
        """``stream``'s next work waits for ``after`` (an event on the engine's
        stream), or for all work queued on the engine's stream now."""
        if after is None:
            stream.wait_stream(self._cuda.current_stream(self.device))
        else:
            stream.wait_event(after)

    def submit(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        to_host: bool,
        after=None,
        timed: bool = False,
    ) -> CopyHandle:
        """Queues the copies after ``after``; returns their handle."""
        stream = self.streams[to_host]
        self.order(stream, after)
        start = None
        with self._cuda.stream(stream):
            if timed:
                start = self._cuda.Event(enable_timing=True)
                start.record(stream)
            if self._batch is not None:
                keep = tuple(
                    torch.from_numpy(np.require(a, np.int64, ("C", "W"))) for a in (src, dst, sizes)
                )
                # Host -> GPU reads memory no stream writes: the driver may
                # prefetch it out of order (as vLLM does for loads).
                self._batch(*keep, is_src_access_order_any=not to_host)
            else:
                d, s = self._spans.views(dst, sizes), self._spans.views(src, sizes)
                self._foreach_copy(d, s, non_blocking=True)
                keep = (d, s)
            event = self._cuda.Event(enable_timing=timed)
            event.record(stream)
        return CopyHandle(event, keep, start)


class CopyEngineMover:
    """The PageMover interface (post, poll, close) over the copy engines.

    ``copies``: what submits the batches (CudaCopies on the KV cache's
    device by default; a fake one in tests)."""

    path = "copy engine"
    # The worker posts at once, with the step's fence: the copies wait for it
    # on the GPU (NIXL's posts wait for it on the host instead).
    orders_on_gpu = True

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        host_pool: torch.Tensor,
        block_dims: dict[str, int] | None = None,
        copies=None,
        page_blocks: int = 1,
    ):
        self.regions = block_regions(kv_caches, num_blocks, block_dims)
        self.table = RegionTable.of(self.regions)
        self.num_blocks = num_blocks
        self.block_bytes = self.table.row_bytes
        slot_bytes = host_pool.shape[1] * host_pool.element_size()
        if slot_bytes != self.block_bytes:
            raise KVBMConfigError(
                f"host pool slot is {slot_bytes} bytes but one block of the "
                f"registered KV cache is {self.block_bytes}; KV layout mismatch"
            )
        self.num_slots = host_pool.shape[0]
        self._host_base = host_pool.data_ptr()
        first = next(iter(kv_caches.values()))
        self.copies = copies or CudaCopies(
            first.device, SpanViews([*kv_caches.values(), host_pool])
        )
        self.path = f"copy engine ({self.copies.name}, a stream each for stores and loads)"
        self.page_copies = page_copies(self.table, page_blocks)
        missing = getattr(self.copies, "missing", "")
        if missing and missing not in _warned:
            _warned.add(missing)
            logger.warning(
                "KVBM: vLLM's batched block copy is missing here: %s. Each copy is a "
                "cudaMemcpyAsync of its own through PyTorch's _foreach_copy_, with a tensor "
                "view made per copy on the engine thread (%s), where vLLM's swap_blocks_batch "
                "posts a job in one call; install vLLM's CUDA wheels",
                missing,
                self.page_copies,
            )

    def _runs(self, to_host: bool, block_ids, slots):
        blocks, rows = checked_ids(block_ids, slots, self.num_blocks, self.num_slots)
        return copy_runs(self.table, self._host_base, blocks, rows, to_host)

    def post(
        self, to_host: bool, block_ids: list[int], slots: list[int], after=None, timed: bool = False
    ) -> CopyHandle:
        """Queues the copies of blocks to or from host pool rows after
        ``after`` (a step fence: its CUDA event); returns a handle for
        ``poll``. Raises on failure (nothing was queued)."""
        src, dst, sizes = self._runs(to_host, block_ids, slots)
        return self.copies.submit(
            src, dst, sizes, to_host, after=getattr(after, "event", None), timed=timed
        )

    def poll(self, handle: CopyHandle) -> str:
        """ "DONE", "PROC" or "ERR" (a CUDA error the event reports)."""
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
