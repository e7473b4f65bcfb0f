"""A load's landed pages are copied into the engine while its fetch reads the rest.

The disk tier lives on a FUSE mount made slow (helpers/blocking_fs.py: each
metadata call may block up to 0.3 s), so a fetch of twelve pages takes
seconds and lands them a few at a time. Through a real KVBMWorker (NIXL
copies): the first pages reach their engine blocks before the load is
reported, the load is reported once, every block then holds its page, and a
corrupt page late in the fetch fails the whole load only after the copies
already posted have ended.
"""

from __future__ import annotations

import time

import torch

from helpers.tier_pages import key
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.disk.store import DiskStore
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from test_worker_unit import gen, harness  # noqa: F401 (fixtures)

PAGES = 12


def _write_pages(mount, page_bytes: int) -> list[torch.Tensor]:
    writer = DiskStore(str(mount.root), 64 << 20, page_bytes, "ns", 0, 1)
    g = torch.Generator().manual_seed(21)
    pages = [
        torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g) for _ in range(PAGES)
    ]
    for i, p in enumerate(pages):
        assert writer.put(key(i), p)
    paths = [writer._disk._key_to_path(writer._ckey(key(i))) for i in range(PAGES)]
    writer.close()
    return pages, paths


def _load(h, mount, blocks):
    h.worker.add_tier(DiskStore(str(mount.path), 64 << 20, h.lay.block_bytes(), "ns", 0, 1))
    job = TransferJob(
        7, "R", blocks, list(range(PAGES)), fetch=[(i, "disk", key(i)) for i in range(PAGES)]
    )
    h.worker.start_loads(KVBMConnectorMetadata(loads=[job]))


def _step_until_reported(h, mount, blocks, pages) -> bool:
    """Loads the pages into ``blocks`` through the slow mount, stepping the
    worker until the load is reported; whether block 0 held its page before
    that while some block did not hold its own yet (copied while reading)."""
    early = False
    with mount.slow(blocked_s=0.3, open_s=0.05):
        _load(h, mount, blocks)
        deadline = time.monotonic() + 60
        while "R" not in h.recving:
            assert time.monotonic() < deadline, "the load never ended"
            h.step()
            if not early and "R" not in h.recving:
                early = torch.equal(h.lay.slot_bytes(blocks[0]), pages[0]) and not all(
                    torch.equal(h.lay.slot_bytes(b), p) for b, p in zip(blocks, pages)
                )
            time.sleep(0.002)
    assert h.recving == ["R"]
    assert not h.worker._early and not h.worker._early_parts
    return early


def test_landed_pages_reach_the_engine_before_the_fetch_ends(mount, harness):
    h = harness()
    pages, _ = _write_pages(mount, h.lay.block_bytes())
    blocks = list(range(10, 10 + PAGES))
    assert _step_until_reported(h, mount, blocks, pages), "no page copied before the fetch ended"
    assert not h.meta.loads_failed and not h.worker.get_block_ids_with_load_errors()
    assert h.meta.bytes_loaded == PAGES * h.lay.block_bytes()
    for b, p in zip(blocks, pages):
        assert torch.equal(h.lay.slot_bytes(b), p)


def test_a_corrupt_page_after_early_copies_fails_the_whole_load(mount, harness):
    h = harness()
    pages, paths = _write_pages(mount, h.lay.block_bytes())
    with open(paths[PAGES - 2], "r+b") as f:  # a late page's payload
        f.seek(HEADER_BYTES + 5)
        b = f.read(1)
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([b[0] ^ 0x01]))
    blocks = list(range(20, 20 + PAGES))
    assert _step_until_reported(h, mount, blocks, pages)
    assert h.meta.loads_failed["R"] == 1
    # every block of the load is recomputed, those copied early included
    assert h.worker.get_block_ids_with_load_errors() == set(blocks)
