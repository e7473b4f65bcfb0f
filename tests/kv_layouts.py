"""KV caches laid out like vLLM's, filled with random bytes, for the NIXL tests.

Each builder returns a ``KVLayout``: the raw memory (``raw``: tensors whose
bytes are what NIXL moves) and ``caches``: the per-layer views vLLM would hand
to ``register_kv_caches``. ``page(raw, layer_idx, b)`` gives the bytes one
block of one layer contributes to a host slot, in slot order, so the expected
content of a host slot holding block ``b`` is ``slot_bytes(raw, b)``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
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

    def raw_equal(self, other: list[torch.Tensor]) -> bool:
        return all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(self.raw, other))


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def cpu_layout(num_layers: int, num_blocks: int, heads: int, block_size: int,
               head_size: int, gen: torch.Generator, dtype=torch.bfloat16,
               pad: int = 4096) -> KVLayout:
    """vLLM CPU: one int8 buffer, per layer a [nb, heads, bs, 2*hs] view, one
    layer after another. ``pad`` random guard bytes before and after."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = num_blocks * heads * block_size * 2 * head_size * elem
    buf = torch.empty(pad + num_layers * per_layer + pad, dtype=torch.int8)
    random_fill(buf, gen)

    def views(raw):
        (b,) = raw
        return {layer_name(i): b[pad + i * per_layer: pad + (i + 1) * per_layer]
                .view(dtype).view(num_blocks, heads, block_size, 2 * head_size)
                for i in range(num_layers)}

    def pages(raw, blk):
        return [v[blk] for v in views(raw).values()]

    return KVLayout(num_blocks, num_layers, [buf], views, pages)


def flash_layout(num_layers: int, num_blocks: int, block_size: int, heads: int,
                 head_dim: int, gen: torch.Generator, dtype=torch.bfloat16,
                 hnd: bool = False) -> KVLayout:
    """CUDA flash-attention: per layer a separate [2, nb, bs, heads, hd] tensor
    (here in CPU memory). ``hnd``: physical [2, nb, heads, bs, hd] memory seen
    through a permuted [2, nb, bs, heads, hd] view, as vLLM's HND layout does."""
    shape = (2, num_blocks, heads, block_size, head_dim) if hnd else \
        (2, num_blocks, block_size, heads, head_dim)
    raw = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
    for r in raw:
        random_fill(r, gen)

    def views(raw_):
        return {layer_name(i): (r.permute(0, 1, 3, 2, 4) if hnd else r)
                for i, r in enumerate(raw_)}

    def pages(raw_, blk):
        # host slot order: layer by layer, K page then V page; raw (physical) bytes
        return [r[kv, blk] for r in raw_ for kv in (0, 1)]

    return KVLayout(num_blocks, num_layers, raw, views, pages)
