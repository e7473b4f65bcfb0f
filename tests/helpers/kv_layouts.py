"""KV caches laid out like vLLM's, filled with random bytes, for the NIXL tests.

Each builder returns a ``KVLayout``: the raw memory (``raw``: tensors whose
bytes are what NIXL moves) and ``caches``: the per-layer views vLLM would hand
to ``register_kv_caches``. ``page(raw, layer_idx, b)`` gives the bytes one
block of one layer contributes to a host slot, in slot order, so the expected
content of a host slot holding block ``b`` is ``slot_bytes(raw, b)``.

``vllm_layout`` lays a KV cache out exactly as vLLM 0.32 does on every device
(``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py: one allocation,
per layer a logical ``[blocks, heads, tokens, content]`` view whose strides
follow the resolved ``KVCacheLayout``); it imports no vLLM, so
benchmarks/gpu_check.py uses it on a machine without vLLM, and
tests/unit/test_page_mover_vllm_layouts.py checks it against vLLM's own function.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch


def agent_name(prefix: str = "kvbm-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def random_fill(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes into a contiguous tensor of any dtype (NaN patterns included)."""
    flat = t.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@dataclass
class KVLayout:
    num_blocks: int
    num_layers: int
    raw: list[torch.Tensor]
    views: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]
    # (raw, block) -> one layer's pages of that block, in host-slot order
    pages: Callable[[list[torch.Tensor], int], list[torch.Tensor]]
    # layer -> block dim, as vLLM's declared layout gives it (None: not given)
    block_dims: dict[str, int] | None = field(default=None)

    @property
    def caches(self) -> dict[str, torch.Tensor]:
        return self.views(self.raw)

    def slot_bytes(self, b: int, raw: list[torch.Tensor] | None = None) -> torch.Tensor:
        return torch.cat([as_bytes(p) for p in self.pages(raw or self.raw, b)])

    def block_bytes(self) -> int:
        return self.slot_bytes(0).numel()

    def clone_raw(self) -> list[torch.Tensor]:
        return [r.clone() for r in self.raw]

    def copy_block(self, raw: list[torch.Tensor], src: int, dst: int) -> None:
        """Reference copy of one block's pages (torch, on the given raw memory)."""
        for s, d in zip(self.pages(raw, src), self.pages(raw, dst)):
            d.copy_(s.clone())

    def zero_block(self, b: int) -> None:
        for p in self.pages(self.raw, b):
            p.zero_()

    def fill_block(self, b: int, gen: torch.Generator) -> None:
        """New random bytes in every page of block ``b`` (a forward pass writing it)."""
        for p in self.pages(self.raw, b):
            random_fill(p, gen)

    def raw_equal(self, other: list[torch.Tensor]) -> bool:
        return all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(self.raw, other))


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def cpu_layout(
    num_layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    gen: torch.Generator,
    dtype=torch.bfloat16,
    pad: int = 4096,
) -> KVLayout:
    """vLLM CPU: one int8 buffer, per layer a [nb, heads, bs, 2*hs] view, one
    layer after another. ``pad`` random guard bytes before and after."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = num_blocks * heads * block_size * 2 * head_size * elem
    buf = torch.empty(pad + num_layers * per_layer + pad, dtype=torch.int8)
    random_fill(buf, gen)

    def views(raw):
        (b,) = raw
        return {
            layer_name(i): b[pad + i * per_layer : pad + (i + 1) * per_layer]
            .view(dtype)
            .view(num_blocks, heads, block_size, 2 * head_size)
            for i in range(num_layers)
        }

    def pages(raw, blk):
        return [v[blk] for v in views(raw).values()]

    return KVLayout(num_blocks, num_layers, [buf], views, pages)


def flash_layout(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    gen: torch.Generator,
    dtype=torch.bfloat16,
    hnd: bool = False,
) -> KVLayout:
    """CUDA flash-attention: per layer a separate [2, nb, bs, heads, hd] tensor
    (here in CPU memory). ``hnd``: physical [2, nb, heads, bs, hd] memory seen
    through a permuted [2, nb, bs, heads, hd] view, as vLLM's HND layout does."""
    shape = (
        (2, num_blocks, heads, block_size, head_dim)
        if hnd
        else (2, num_blocks, block_size, heads, head_dim)
    )
    raw = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
    for r in raw:
        random_fill(r, gen)

    def views(raw_):
        return {layer_name(i): (r.permute(0, 1, 3, 2, 4) if hnd else r) for i, r in enumerate(raw_)}

    def pages(raw_, blk):
        # host slot order: layer by layer, K page then V page; raw (physical) bytes
        return [r[kv, blk] for r in raw_ for kv in (0, 1)]

    return KVLayout(num_blocks, num_layers, raw, views, pages)


# vLLM 0.32's KVCacheLayout: logical [L, B, H, N, C] dims in physical order,
# outermost first (vllm/v1/kv_cache_layout.py).
VLLM_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of ``shape`` (logical order) laid out in ``order``
    (vLLM's compute_layout_strides without padding)."""
    strides = [0] * len(shape)
    current = 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    return tuple(strides)


def vllm_layout(
    layout: str,
    num_layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    gen: torch.Generator | None,
    dtype=torch.bfloat16,
    mla: bool = False,
    kernel_split: int = 1,
    device: str | torch.device = "cpu",
    pad: int = 4096,
) -> KVLayout:
    """KV caches as vLLM 0.32 allocates them for one group of full-attention
    layers (FlashAttention: LBNHC, the default; FlashInfer on SM100 and the CPU
    backend: LBHNC; packed: BLHNC; MLA: one head slot of ``head_size`` latent
    content, no separate V). ``kernel_split``: the attention kernel's block is
    ``block_size / kernel_split`` tokens, so each layer's view has
    ``num_blocks * kernel_split`` kernel blocks. ``pad`` guard bytes (random,
    like the rest) lie before and after the allocation."""
    order = VLLM_LAYOUTS[layout]
    elem = torch.empty((), dtype=dtype).element_size()
    content = head_size * elem * (1 if mla else 2)  # C in bytes: K and V, or latent
    heads = 1 if mla else heads
    assert block_size % kernel_split == 0
    if kernel_split > 1:
        assert order[:2] in ((0, 1),), "vLLM splits blocks only in layer-outer layouts"
    shape = (num_layers, num_blocks * kernel_split, heads, block_size // kernel_split, content)
    strides = layout_strides(shape, order)
    total = math.prod(shape)
    buf = torch.empty(pad + total + pad, dtype=torch.int8, device=device)
    if gen is not None:
        random_fill(buf, gen)
    page = heads * block_size * content  # one layer's bytes of one (manager) block

    def views(raw):
        (b,) = raw
        v5 = torch.as_strided(b, shape, strides, storage_offset=b.storage_offset() + pad)
        return {layer_name(i): v5[i].view(dtype) for i in range(num_layers)}

    # Physical byte runs of block ``blk`` in host-slot order: per layer, the
    # dense page; heads outside the block dim (LHBNC) are a run each.
    heads_outside = strides[2] > strides[1] and heads > 1
    run = page // heads if heads_outside else page
    block_stride = strides[1] * kernel_split

    def pages(raw, blk):
        (b,) = raw
        flat = b.view(torch.uint8)
        out = []
        for i in range(num_layers):
            for h in range(heads) if heads_outside else [0]:
                start = pad + i * strides[0] + blk * block_stride + h * strides[2]
                out.append(flat[start : start + run])
        return out

    lay = KVLayout(
        num_blocks,
        num_layers,
        [buf],
        views,
        pages,
        block_dims={layer_name(i): 0 for i in range(num_layers)},
    )
    return lay
