"""Which copy path moves pages between the engine's KV cache and the host pool, said at startup.

A KV cache in GPU memory: the GPU's copy engines in batches on a stream of
the mover's own (copy_engine.py), as vLLM's own offloading does; a NIXL
agent copying to itself would route device memory through UCX (TCP or
emulated 8 KiB pieces where there is no RDMA NIC). A KV cache in host memory
(vLLM's CPU build): NIXL's UCX ``self`` transport (page_mover.py). Disk and
remote tiers never go through either: they read and write host slots.

The log line gives the path, how a page is cut into copies, and the GB/s of
one page stored and loaded back at startup (the blocks keep their bytes;
nothing runs on the engine yet).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_kvbm.worker.copy_runs import PageCopies
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT, MAX_BLOCK_MAJOR_TOKENS

logger = logging.getLogger(__name__)

# Bound on the startup round trip: a copy path that cannot move one page in
# this long is reported, and the engine starts anyway.
ROUND_TRIP_TIMEOUT_S = 10.0
_POLL_S = 0.001


def make_mover(kv_caches: dict[str, torch.Tensor], num_blocks: int, host_rows: torch.Tensor,
               backend: str, name: str, block_dims: dict[str, int] | None,
               page_blocks: int):
    """The mover for this KV cache's memory, with its choice logged."""
    first = next(iter(kv_caches.values()))
    if first.is_cuda:
        from vllm_kvbm.worker.copy_engine import CopyEngineMover

        mover = CopyEngineMover(kv_caches, num_blocks, host_rows, block_dims,
                                page_blocks=page_blocks)
    else:
        from vllm_kvbm.worker.page_mover import PageMover

        mover = PageMover(kv_caches, num_blocks, host_rows, backend=backend, name=name,
                          block_dims=block_dims)
    copies = getattr(mover, "page_copies", None) or nixl_page_copies(mover.regions, page_blocks)
    hint = ""
    if first.is_cuda and copies.best > page_blocks:
        # Layer by layer (LBNHC, LBHNC), a host row and the engine cache cross:
        # vLLM did not take the layout KVBM asks for (engine_info.py).
        hint = (f"; the KV cache is laid out layer by layer: {BLOCK_MAJOR_LAYOUT}, which KVBM "
                f"asks vLLM for, makes a page of consecutive blocks one copy (vLLM keeps its "
                f"own when VLLM_KV_CACHE_LAYOUT is set, an attention backend refuses "
                f"{BLOCK_MAJOR_LAYOUT}, or blocks exceed {MAX_BLOCK_MAJOR_TOKENS} tokens)")
    logger.info("KVBM worker: engine<->host copies by %s; %s; one-page round trip %s%s",
                mover.path, copies, round_trip(mover, page_blocks), hint)
    return mover


def nixl_page_copies(regions, page_blocks: int) -> PageCopies:
    """NIXL's prepared descriptors are one layer block each: never merged."""
    n = page_blocks * len(regions)
    return PageCopies(page_blocks, n, n, min(r.layer_block_bytes for r in regions))


def round_trip(mover, page_blocks: int) -> str:
    """One page stored into host rows and loaded back into the same blocks,
    polled every millisecond: "N GB/s", or why it could not be measured."""
    n = min(page_blocks, mover.num_blocks, mover.num_slots)
    blocks = list(range(n))
    start = time.perf_counter()
    try:
        for to_host in (True, False):
            handle = mover.post(to_host, blocks, blocks)
            while (state := mover.poll(handle)) == "PROC":
                if time.perf_counter() - start > ROUND_TRIP_TIMEOUT_S:
                    return f"not measured: no completion within {ROUND_TRIP_TIMEOUT_S:g} s"
                time.sleep(_POLL_S)
            if state != "DONE":
                return f"not measured: the copy ended {state}"
    except Exception as err:  # noqa: BLE001 - said at startup; the first job says it again
        return f"not measured: {type(err).__name__}: {err}"
    elapsed = max(time.perf_counter() - start, 1e-9)
    nbytes = 2 * n * int(np.sum([r.layer_block_bytes for r in mover.regions]))
    return f"{nbytes / elapsed / 1e9:.2f} GB/s ({n} blocks each way)"
