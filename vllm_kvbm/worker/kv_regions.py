"""Where each vLLM block's bytes live in the engine's KV cache.

A vLLM block is one *layer block* per layer (and per K and V where they are
apart); ``block_regions`` finds them for any layout with a block dimension,
as runs of equally strided layer blocks: what every copy path names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvbm.config import KVBMConfigError


@dataclass(frozen=True)
class BlockRegion:
    """One run of equally strided layer blocks: block ``b``'s lives at
    base + b * stride."""

    base: int
    stride: int
    layer_block_bytes: int


def block_dim_of(
    name: str, t: torch.Tensor, num_blocks: int, declared: int | None
) -> tuple[int, int]:
    """(block dim, kernel blocks per block) of one layer's KV cache view.

    ``declared`` comes from vLLM's KV layout (vllm_kvbm.vllm_layout). Without
    it the dim is the one of size ``num_blocks``, and only if exactly one dim
    has that size: with a K/V dim of 2 and num_blocks == 2, or num_blocks ==
    num_kv_heads, guessing would copy the wrong bytes.
    """
    shape = tuple(t.shape)
    if declared is not None:
        if not -t.dim() <= declared < t.dim():
            raise KVBMConfigError(
                f"KV cache of layer {name} has shape {shape}, but vLLM's KV layout puts "
                f"the block dimension at index {declared}; this KV layout is unsupported"
            )
        d = declared % t.dim()
        if shape[d] < num_blocks or shape[d] % num_blocks:
            raise KVBMConfigError(
                f"KV cache of layer {name} has shape {shape}: its block dimension {d} "
                f"(from vLLM's KV layout) has {shape[d]} entries, not a multiple of "
                f"num_blocks={num_blocks}; this KV layout is unsupported"
            )
        # vLLM splits a block into equal kernel blocks when the attention
        # kernel's block size is smaller; they are adjacent in memory.
        return d, shape[d] // num_blocks
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise KVBMConfigError(
            f"KV cache of layer {name} has shape {shape} with no "
            f"dimension of size num_blocks={num_blocks}; this KV layout is unsupported"
        )
    if len(dims) > 1:
        raise KVBMConfigError(
            f"KV cache of layer {name} has shape {shape}: dimensions {dims} all have "
            f"size num_blocks={num_blocks}, and vLLM's KV layout (which says which one "
            f"holds the blocks) was not available; cannot tell which to copy"
        )
    return dims[0], 1


def block_view(
    name: str, t: torch.Tensor, num_blocks: int, block_dims: dict[str, int] | None
) -> tuple[torch.Tensor, int, int]:
    """(view, block dim, kernel blocks per block) of one layer's KV cache: the
    view splits a dim holding kernel blocks into (num_blocks, kernel blocks),
    so the block dim indexes vLLM blocks."""
    declared = None if block_dims is None else block_dims.get(name)
    d, ratio = block_dim_of(name, t, num_blocks, declared)
    if ratio > 1:
        t = t.unflatten(d, (num_blocks, ratio))
    return t, d, ratio


def block_regions(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, block_dims: dict[str, int] | None = None
) -> list[BlockRegion]:
    """Finds where each block's bytes live, for any layout with a block dim.

    vLLM 0.32 hands every layer as a ``[blocks, heads, tokens, content]``
    view whose strides follow the resolved KV layout (LBNHC, LBHNC, BLHNC, ...);
    older flash-attention layouts put K/V first: ``[2, num_blocks, ...]``.
    Dims laid out outside the block dim (larger stride: the K/V dim, heads in
    LHBNC) index regions; the dims inside must be one dense layer block (in any
    order: HND memory seen through an NHD view is still one run of bytes).
    """
    regions = []
    for name, t in kv_caches.items():
        t, d, ratio = block_view(name, t, num_blocks, block_dims)
        elem = t.element_size()
        block_stride = t.stride()[d]
        others = [i for i in range(t.dim()) if i != d]
        outer = [i for i in others if t.shape[i] > 1 and t.stride()[i] > block_stride]
        inner = [i for i in others if i not in outer]
        expected = 1
        for stride, size in sorted((t.stride()[i], t.shape[i]) for i in inner if t.shape[i] > 1):
            if stride != expected:
                raise KVBMConfigError(
                    f"KV cache of layer {name}: a layer block is not contiguous "
                    f"(shape {tuple(t.shape)}, stride {t.stride()}); unsupported layout"
                )
            expected *= size
        layer_block = expected * elem
        if num_blocks > 1 and block_stride * elem < layer_block:
            raise KVBMConfigError(
                f"KV cache of layer {name}: blocks overlap (shape {tuple(t.shape)}, "
                f"stride {t.stride()}); unsupported layout"
            )
        for idx in np.ndindex(*[t.shape[i] for i in outer]):
            offset = sum(j * t.stride()[i] for i, j in zip(outer, idx)) * elem
            regions.append(BlockRegion(t.data_ptr() + offset, block_stride * elem, layer_block))
    return _distinct(regions)


def _distinct(regions: list[BlockRegion]) -> list[BlockRegion]:
    """One region per run of memory: with vLLM's hybrid allocator a layer of
    each KV cache group views the same tensor (block b belongs to one group
    at a time), a Mamba layer's state being a shorter view of its block than
    an attention layer's; the block's bytes are copied once, the longest view."""
    longest: dict[tuple[int, int], int] = {}
    for r in regions:
        key = (r.base, r.stride)
        longest[key] = max(longest.get(key, 0), r.layer_block_bytes)
    return [BlockRegion(base, stride, n) for (base, stride), n in longest.items()]


def checked_ids(block_ids, slots, num_blocks: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """A job's engine blocks and host rows as int64 arrays, refused (before
    anything is copied) unless paired one to one and in range."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    rows = np.asarray(slots, dtype=np.int64)
    if blocks.shape != rows.shape or blocks.ndim != 1:
        raise ValueError(f"{len(block_ids)} block ids but {len(slots)} slots")
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise IndexError(
            f"block ids must be in [0, {num_blocks}), got {blocks.min()}..{blocks.max()}"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= num_slots):
        raise IndexError(f"host slots must be in [0, {num_slots}), got {rows.min()}..{rows.max()}")
    return blocks, rows
