"""Pages, keys and sizes shared by the disk and remote store tests."""

from __future__ import annotations

import torch

from vllm_kvbm.tiers.page_format import disk_page_bytes

MiB = 1024 * 1024
BIG = 2 * MiB          # the production page size
SMALL = 64 * 1024 + 7  # odd, not 4 KiB aligned


def phys(page_bytes: int) -> int:
    return disk_page_bytes(page_bytes)


def page(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return bytes([i % 256]) * 16 + i.to_bytes(16, "big")


def put_where_the_scheduler_sees(store, scheduler_side, keys, tier: str = "disk",
                                 timeout: float = 10.0) -> None:
    """Writes a page for each key with a real store, as a worker would, and
    waits until the scheduler's view of that tier finds every one."""
    import time

    zeros = torch.zeros(scheduler_side.info.block_bytes, dtype=torch.uint8)
    for key in keys:
        assert store.put(key, zeros)
    deadline = time.monotonic() + timeout
    while not all(tier_of(scheduler_side.lower, key) == tier for key in keys):
        assert time.monotonic() < deadline, f"{tier} writes never became visible"
        time.sleep(0.05)


def tier_of(lower, key: bytes):
    """The lower tier that holds ``key`` (the first in lookup order), or None."""
    run = lower.find_run([key])
    return run[0] if run else None
