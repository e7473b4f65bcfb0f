"""The copies that move a job's blocks: (source, destination, bytes), as few as the layouts allow.

A block is one layer block per region (kv_regions.py) in the engine's KV
cache and one row of the host pool (regions side by side). A job's copies
are listed block by block, region by region, and merged wherever a copy
continues the previous one on both sides: with a KV cache laid out block by
block across layers (vLLM's BLNHC/BLHNC) a whole block is one copy and a run
of consecutive blocks one copy; laid out layer by layer (LBNHC, the CUDA
default) the host and engine orders cross, and each layer block is a copy of
its own. Everything is numpy over the job's blocks: no Python loop per
block or per copy on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_kvbm.worker.kv_regions import BlockRegion


@dataclass(frozen=True)
class RegionTable:
    """Per region: engine base address and block stride, layer block bytes,
    and its offset inside a host pool row of ``row_bytes``."""

    kv_base: np.ndarray
    kv_stride: np.ndarray
    sizes: np.ndarray
    host_offset: np.ndarray
    row_bytes: int

    @classmethod
    def of(
        cls,
        regions: list[BlockRegion],
        host_offset: np.ndarray | None = None,
        row_bytes: int | None = None,
    ) -> "RegionTable":
        """Regions that continue each other in every block (same stride, one
        ending where the next starts, as a block's layers do in BLHNC/BLNHC)
        are joined once here: a post then lists one entry per block, not one
        per layer block, before merging consecutive blocks. A host row holds
        ``regions`` side by side unless ``host_offset`` and ``row_bytes`` say
        where they are (some of a row's regions: one layer's)."""
        sizes = np.array([r.layer_block_bytes for r in regions], dtype=np.int64)
        base = np.array([r.base for r in regions], dtype=np.int64)
        stride = np.array([r.stride for r in regions], dtype=np.int64)
        if host_offset is None:
            host = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        else:
            host = np.asarray(host_offset, dtype=np.int64)
        row = int(sizes.sum()) if row_bytes is None else row_bytes
        starts = np.flatnonzero(
            np.concatenate(
                (
                    [True],
                    (base[1:] != base[:-1] + sizes[:-1])
                    | (stride[1:] != stride[:-1])
                    | (host[1:] != host[:-1] + sizes[:-1]),
                )
            )
        )
        return cls(
            kv_base=base[starts],
            kv_stride=stride[starts],
            sizes=np.add.reduceat(sizes, starts) if sizes.size else sizes,
            host_offset=host[starts],
            row_bytes=row,
        )


def merge_runs(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies that continue the previous one on both sides joined into one."""
    if src.size <= 1:
        return src, dst, sizes
    ends_src, ends_dst = src[:-1] + sizes[:-1], dst[:-1] + sizes[:-1]
    starts = np.flatnonzero(np.concatenate(([True], (src[1:] != ends_src) | (dst[1:] != ends_dst))))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


def copy_runs(
    table: RegionTable, host_base: int, blocks: np.ndarray, rows: np.ndarray, to_host: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source addresses, destination addresses, bytes) of copying engine
    ``blocks`` into (or, ``to_host`` False, out of) host pool ``rows``."""
    b = blocks.astype(np.int64)[:, None]
    r = rows.astype(np.int64)[:, None]
    kv = (table.kv_base[None, :] + b * table.kv_stride[None, :]).ravel()
    host = (host_base + r * table.row_bytes + table.host_offset[None, :]).ravel()
    sizes = np.broadcast_to(table.sizes, (len(blocks), len(table.sizes))).ravel()
    return merge_runs(*((kv, host) if to_host else (host, kv)), sizes)


@dataclass(frozen=True)
class PageCopies:
    """How a page of ``page_blocks`` blocks is cut into copies."""

    page_blocks: int
    best: int  # copies when the page's engine blocks are consecutive
    worst: int  # copies when none of them are
    smallest: int  # bytes of the smallest copy

    def __str__(self) -> str:
        return (
            f"a {self.page_blocks}-block page is {self.best} "
            f"{'copy' if self.best == 1 else 'copies'} (consecutive engine "
            f"blocks) to {self.worst} (scattered), the smallest {self.smallest / 1024:g} KiB"
        )


def page_copies(table: RegionTable, page_blocks: int) -> PageCopies:
    """Copies per page, best and worst case, and the smallest copy."""
    rows = np.arange(page_blocks)
    _, _, best = copy_runs(table, 0, rows, rows, True)
    _, _, worst = copy_runs(table, 0, rows * 2, rows, True)
    return PageCopies(page_blocks, len(best), len(worst), int(min(best.min(), worst.min())))
