"""Which copy path moves pages between the engine's KV cache and the host pool, said at startup.

A KV cache in GPU memory: the GPU's copy engines in batches on a stream of
the mover's own (copy_engine.py), as vLLM's own offloading does; a NIXL
agent copying to itself would route device memory through UCX (TCP or
emulated 8 KiB pieces where there is no RDMA NIC). A KV cache in host memory
(vLLM's CPU build): NIXL's UCX ``self`` transport (page_mover.py) and plain
copies shared by a few threads (host_copies.py), both measured, the faster
kept (the log line gives the other's figures too); plain copies without
measuring where a core is free of vLLM's OpenMP threads, since their stores
are copied there during the forward pass (layer_copies.py). Disk and remote tiers
never go through either: they read and write host slots.

The log line gives the path, how a page is cut into copies, and the GB/s of
a round trip at startup, before the engine runs anything: a one-page warm-up
each way, then ``ROUND_TRIP_PAGES`` pages stored into host rows and loaded
back, each way one transfer (as a hit's or a prefill's job of several pages
is posted), timed by CUDA events on the copy engines (their time on the GPU) and
by perf_counter until each transfer is done for NIXL (which copies inside
its post on CPU). Every byte is checked: the stored rows against the
engine's blocks read through PyTorch, then the bitwise complement of those
rows loaded into the blocks, then the rows loaded back (the blocks end with
the bytes they had). A path that moves a wrong byte, fails a transfer or
leaves one unfinished is a startup error naming what failed: a cache that
copies wrong bytes must not start.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.worker.copy_runs import PageCopies, RegionTable
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT, MAX_BLOCK_MAJOR_TOKENS

logger = logging.getLogger(__name__)

# Pages the startup round trip times, each way, after a one-page warm-up.
ROUND_TRIP_PAGES = 4
# The paths measured for a KV cache in host memory, in this order (tests
# that need one path's behaviour, such as transfers still running across
# steps, keep only it).
HOST_PATHS = ("nixl", "threads")
# Bound on one transfer of the round trip.
ROUND_TRIP_TIMEOUT_S = 10.0
_POLL_S = 0.0002


class CopyPathError(RuntimeError):
    """The startup round trip found the copy path broken; the engine stops."""


def make_mover(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    host_rows: torch.Tensor,
    backend: str,
    name: str,
    block_dims: dict[str, int] | None,
    page_blocks: int,
    host_path: str = "auto",
    spare: "set[int] | frozenset[int]" = frozenset(),
):
    """The mover for this KV cache's memory, with its choice logged after a
    checked round trip (CopyPathError if it fails). Host memory: NIXL's and
    plain copies in a few threads (host_copies.py) both measured, the faster
    kept, unless ``host_path`` (host_copy_path) names one, or plain copies
    without measuring where a core is ``spare`` (cpus.spare_cpus)."""
    first = next(iter(kv_caches.values()))
    chosen = ""
    if first.is_cuda:
        from vllm_kvbm.worker.copy_engine import CopyEngineMover

        def engines():
            return CopyEngineMover(
                kv_caches, num_blocks, host_rows, block_dims, page_blocks=page_blocks
            )

        if host_path != "auto":
            raise KVBMConfigError(
                f"host_copy_path: {host_path!r} names a copy path of vLLM's CPU build; this "
                f"engine's KV cache is on {first.device}, whose copies run on its copy engines. "
                f'Remove host_copy_path or set it to "auto"'
            )
        candidates = [engines]
    else:
        from vllm_kvbm.worker import page_mover
        from vllm_kvbm.worker.host_copies import HostCopies

        def nixl():
            return page_mover.PageMover(
                kv_caches, num_blocks, host_rows, backend=backend, name=name, block_dims=block_dims
            )

        def threads():
            return HostCopies(kv_caches, num_blocks, host_rows, block_dims, page_blocks)

        paths = HOST_PATHS if host_path == "auto" else (host_path,)
        if host_path == "auto" and "threads" in paths and spare:
            # Plain copies' stores run on that core during the forward pass
            # (layer_copies.py): off the engine's time, whatever either path's speed.
            paths, chosen = ("threads",), " (a core is free of vLLM's OpenMP threads)"
        candidates = [{"nixl": nixl, "threads": threads}[p] for p in paths]
    made, trips = [], []
    try:
        for make in candidates:
            made.append(make())
            trips.append(round_trip(made[-1], kv_caches, host_rows, page_blocks))
    except Unfinished:
        for other in made[:-1]:  # the last may still write: nothing is released under it
            other.close()
        raise
    except Exception:
        for other in made:
            other.close()
        raise
    mover, trip = min(zip(made, trips), key=lambda m: m[1].seconds)
    others = ""
    for other, t in zip(made, trips):
        if other is not mover:
            others += f"; {other.path}: store {t.store_gbps:.2f} GB/s, load {t.load_gbps:.2f} GB/s"
            other.close()
    copies = getattr(mover, "page_copies", None) or nixl_page_copies(mover.regions, page_blocks)
    hint = ""
    if first.is_cuda and copies.best > page_blocks:
        # Layer by layer (LBNHC, LBHNC), a host row and the engine cache cross:
        # vLLM did not take the layout KVBM asks for (engine_info.py).
        hint = (
            f"; the KV cache is laid out layer by layer: {BLOCK_MAJOR_LAYOUT}, which KVBM "
            f"asks vLLM for, makes a page of consecutive blocks one copy (vLLM keeps its "
            f"own when VLLM_KV_CACHE_LAYOUT is set, an attention backend refuses "
            f"{BLOCK_MAJOR_LAYOUT}, or blocks exceed {MAX_BLOCK_MAJOR_TOKENS} tokens)"
        )
    logger.info(
        "KVBM worker: engine<->host copies by %s; %s; %s%s%s",
        mover.path,
        copies,
        trip,
        f" (the faster measured{others})" if others else chosen,
        hint or (" (host_copy_path)" if host_path != "auto" else ""),
    )
    return mover


def nixl_page_copies(regions, page_blocks: int) -> PageCopies:
    """NIXL's prepared descriptors are one layer block each: never merged."""
    n = page_blocks * len(regions)
    return PageCopies(page_blocks, n, n, min(r.layer_block_bytes for r in regions))


class Unfinished(CopyPathError):
    """A round-trip transfer did not finish in time (it may still write)."""


class BlockBytes:
    """The engine's blocks' bytes as host rows lay them out (the regions
    side by side), read through PyTorch's views: not through the path
    under test."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], regions):
        from vllm_kvbm.worker.copy_engine import SpanViews

        self._spans = SpanViews(list(kv_caches.values()))
        self._table = RegionTable.of(regions)  # runs that continue each other joined
        self._sizes = [r.layer_block_bytes for r in regions]
        self._offsets = np.concatenate(([0], np.cumsum(self._sizes)))

    def read(self, block: int) -> torch.Tensor:
        t = self._table
        row = torch.empty(t.row_bytes, dtype=torch.uint8)
        views = self._spans.views(t.kv_base + block * t.kv_stride, t.sizes)
        for view, off, n in zip(views, t.host_offset.tolist(), t.sizes.tolist()):
            row[off : off + n].copy_(view)  # device -> host, in the engine stream's order
        return row

    def where(self, byte: int) -> str:
        i = int(np.searchsorted(self._offsets, byte, side="right")) - 1
        return (
            f"byte {byte - int(self._offsets[i])} of layer block region {i + 1} of "
            f"{len(self._sizes)} ({self._sizes[i]} bytes)"
        )


def _transfer(mover, to_host: bool, blocks: list[int], rows: list[int], what: str) -> float:
    """One transfer, waited for: its seconds (CUDA events where the mover
    records them, else perf_counter from the post to its completion)."""
    timed = getattr(mover, "orders_on_gpu", False)
    start = time.perf_counter()
    try:
        handle = (
            mover.post(to_host, blocks, rows, timed=True)
            if timed
            else mover.post(to_host, blocks, rows)
        )
    except Exception as err:
        raise CopyPathError(f"{what}: the post failed: {type(err).__name__}: {err}") from err
    while (state := mover.poll(handle)) == "PROC":
        if time.perf_counter() - start > ROUND_TRIP_TIMEOUT_S:
            raise Unfinished(f"{what}: not finished within {ROUND_TRIP_TIMEOUT_S:g} s")
        time.sleep(_POLL_S)
    elapsed = time.perf_counter() - start
    if state != "DONE":
        raise CopyPathError(f"{what}: the transfer ended {state}")
    gpu = handle.seconds() if timed else None
    return elapsed if gpu is None else gpu


def _pages(mover, to_host: bool, blocks: list[int], rows: list[int], g: int, what: str) -> float:
    """``blocks`` moved page by page; the seconds they took."""
    return sum(
        _transfer(mover, to_host, blocks[i : i + g], rows[i : i + g], what)
        for i in range(0, len(blocks), g)
    )


def _check(
    reader: BlockBytes, blocks: list[int], rows: list[int], want: torch.Tensor, what: str
) -> None:
    """Each engine block of ``blocks`` holds its row of ``want``."""
    for b, r, w in zip(blocks, rows, want):
        got = reader.read(b)
        if not torch.equal(got, w):
            byte = int(torch.nonzero(got != w)[0])
            raise CopyPathError(
                f"{what}: engine block {b} and host row {r} differ first at {reader.where(byte)}"
            )


class RoundTrip(str):
    """round_trip's line, with its figures."""

    seconds: float  # store and load together
    store_gbps: float
    load_gbps: float


def round_trip(
    mover,
    kv_caches: dict[str, torch.Tensor],
    host_rows: torch.Tensor,
    page_blocks: int,
    pages: int = ROUND_TRIP_PAGES,
) -> RoundTrip:
    """``pages`` pages stored into host rows and loaded back, every byte
    checked (see the module docstring): "round trip ... GB/s", or
    CopyPathError naming what failed."""
    n = min(pages * page_blocks, mover.num_blocks, host_rows.shape[0] // 2)
    if n < 1:
        trip = RoundTrip("round trip not measured: fewer than 2 host rows")
        trip.seconds, trip.store_gbps, trip.load_gbps = 0.0, 0.0, 0.0
        return trip
    g = min(page_blocks, n)
    blocks, saved, probe = list(range(n)), list(range(n)), list(range(n, 2 * n))
    reader = BlockBytes(kv_caches, mover.regions)
    try:
        _pages(mover, True, blocks[:g], saved[:g], g, "warm-up store")
        _pages(mover, False, blocks[:g], saved[:g], g, "warm-up load")  # the same bytes back
        # timed as a job of several pages is posted: one transfer
        store_s = _pages(mover, True, blocks, saved, n, "store")
        _check(reader, blocks, saved, host_rows[:n], "store")
        torch.bitwise_not(host_rows[:n], out=host_rows[n : 2 * n])  # every byte differs
        load_s = _pages(mover, False, blocks, probe, n, "load")
        _check(reader, blocks, probe, ~host_rows[:n], "load")
        _pages(mover, False, blocks, saved, g, "load back")
        _check(reader, blocks, saved, host_rows[:n], "load back")
    except CopyPathError as err:
        raise type(err)(
            f"KVBM: the startup round trip of pages between the KV cache and the host tier "
            f"through {mover.path} failed: {err}. A cache that copies wrong bytes would serve "
            f"wrong KV, so the engine does not start; on a GPU, bash scripts/gpu_check.sh "
            f"checks each KV layout and copy path on this machine"
        ) from err
    nbytes = n * int(np.sum([r.layer_block_bytes for r in mover.regions]))
    how = "CUDA events" if getattr(mover, "orders_on_gpu", False) else "until done"
    store_gbps = nbytes / max(store_s, 1e-9) / 1e9
    load_gbps = nbytes / max(load_s, 1e-9) / 1e9
    trip = RoundTrip(
        f"round trip of {n} blocks ({nbytes / 2**20:.1f} MiB) each way, every byte "
        f"checked: store {store_gbps:.2f} GB/s, load {load_gbps:.2f} GB/s ({how}, one "
        f"transfer each way, after a one-page warm-up)"
    )
    trip.seconds, trip.store_gbps, trip.load_gbps = store_s + load_s, store_gbps, load_gbps
    return trip
