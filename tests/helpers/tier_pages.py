"""Pages, keys and sizes shared by the disk and remote store tests."""

from __future__ import annotations

import struct

import torch

from vllm_kvbm.tiers import page_format as pf
from vllm_kvbm.tiers.page_checksum import Crc
from vllm_kvbm.tiers.page_format import HEADER_BYTES, disk_page_bytes

MiB = 1024 * 1024
BIG = 2 * MiB  # the production page size
SMALL = 64 * 1024 + 7  # odd, not 4 KiB aligned


def phys(page_bytes: int) -> int:
    return disk_page_bytes(page_bytes)


def page(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return bytes([i % 256]) * 16 + i.to_bytes(16, "big")


def disk_store_for(scheduler_side, directory, **kw):
    """A worker's DiskStore writing where ``scheduler_side`` (a KVBMScheduler)
    looks: its page size and tier namespace, rank 0 of 1, 64 MiB."""
    from vllm_kvbm.tiers.disk.store import DiskStore

    info = scheduler_side.info
    return DiskStore(str(directory), 64 << 20, info.page_bytes, info.tier_namespace, 0, 1, **kw)


def put_where_the_scheduler_sees(
    store, scheduler_side, keys, tier: str = "disk", timeout: float = 10.0
) -> None:
    """Writes a page for each key with a real store, as a worker would, and
    waits until the scheduler's view of that tier finds every one."""
    import time

    zeros = torch.zeros(scheduler_side.info.page_bytes, dtype=torch.uint8)
    for key in keys:
        assert store.put(key, zeros)
    deadline = time.monotonic() + timeout
    while not all(tier_of(scheduler_side.lower, key) == tier for key in keys):
        assert time.monotonic() < deadline, f"{tier} writes never became visible"
        time.sleep(0.05)


def put_on_disk_where_the_scheduler_sees(scheduler_side, directory, keys) -> None:
    """put_where_the_scheduler_sees with a DiskStore of its own in
    ``directory`` (disk_store_for), closed afterwards."""
    store = disk_store_for(scheduler_side, directory)
    try:
        put_where_the_scheduler_sees(store, scheduler_side, keys)
    finally:
        store.close()


def tier_of(lower, key: bytes):
    """The lower tier that holds ``key`` (the first in lookup order), or None."""
    run = lower.find_run([key])
    return run[0] if run else None


def restamp(
    data: bytes,
    *,
    payload: bytes | None = None,
    flags=None,
    mac_alg=None,
    mac=None,
    ns8=None,
    key_field=None,
) -> bytes:
    """``data`` (a stored page) with some header fields or the payload replaced
    and the CRC recomputed (over the header before the seal field, the
    payload, then the seal field), so it passes every integrity check."""
    # magic, version, alg, flags, mac_alg, plen, ns8, key, mac, crc
    f = list(pf.HDR.unpack(data[:HEADER_BYTES]))
    for i, v in ((3, flags), (4, mac_alg), (6, ns8), (7, key_field), (8, mac)):
        if v is not None:
            f[i] = v
    body = data[HEADER_BYTES:] if payload is None else payload
    prefix = pf.HDR.pack(*f[:9], 0)[: pf.MAC_OFF]
    crc = Crc(f[2], prefix)
    crc.update(memoryview(body))
    crc.update(f[8])
    return prefix + f[8] + struct.pack("<I", crc.value) + body


LEAK_SAMPLE = 48  # bytes of a payload searched for, at 16 places


def leaks(stored: bytes, k: bytes, p: torch.Tensor) -> list[str]:
    """What of the key and the KV bytes ``p`` can be found in ``stored``."""
    raw = p.numpy().tobytes()
    found = [
        f"payload@{off}"
        for off in range(0, len(raw) - LEAK_SAMPLE, len(raw) // 16)
        if raw[off : off + LEAK_SAMPLE] in stored
    ]
    for what, needle in (
        ("key", k),
        ("key hex", k.hex().encode()),
        ("key int hex", f"{int.from_bytes(k, 'big'):x}".encode()),
    ):
        if needle in stored:
            found.append(what)
    return found
