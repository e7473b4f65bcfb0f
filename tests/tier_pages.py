"""Pages, keys and sizes shared by the disk and remote store tests."""

from __future__ import annotations

import torch

from vllm_kvbm.tiers.page_format import disk_page_bytes

MiB = 1024 * 1024
BIG = 2 * MiB          # the production page size
SMALL = 64 * 1024 + 7  # odd, not 4 KiB aligned


def phys(block_bytes: int) -> int:
    return disk_page_bytes(block_bytes)


def page(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return bytes([i % 256]) * 16 + i.to_bytes(16, "big")
