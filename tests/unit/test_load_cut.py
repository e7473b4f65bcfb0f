"""A load that runs later than recomputing is cut at the pages landed.

The disk tier lives on a FUSE mount made slow (helpers/blocking_fs.py: each
metadata call may block 0.3 s), far slower than the recompute time the
scheduler hands the job. TierIO cuts the fetch: its reads stop after their
current group, and it reports the load ready with the number of pages
landed, each of them intact in its host slot. The same fetch with no
recompute time known is never cut.
"""

from __future__ import annotations

import time

import torch

from helpers.tier_pages import key
from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob
from vllm_kvbm.tiers.disk.store import DiskStore
from vllm_kvbm.worker.tier_io import TierIO
from test_worker_unit import gen, harness  # noqa: F401 (fixtures)

PAGES = 12
PAGE_BYTES = 64 * 1024


def _pages(mount, page_bytes: int = PAGE_BYTES) -> list[torch.Tensor]:
    writer = DiskStore(str(mount.root), 64 << 20, page_bytes, "ns", 0, 1)
    g = torch.Generator().manual_seed(11)
    pages = [
        torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g) for _ in range(PAGES)
    ]
    for i, p in enumerate(pages):
        assert writer.put(key(i), p)
    writer.close()
    return pages


def _fetch(mount, recompute_s: list[float], first_read_blocked_s: float | None = None):
    """Fetches every page through the mount, slow throughout (reads block up
    to 0.3 s at a time) or, with ``first_read_blocked_s``, blocked that long
    at the start and fast after; returns where it was cut, the pool, the
    worker metadata."""
    io = TierIO(read_timeout_s=20.0)
    io.add(DiskStore(str(mount.path), 64 << 20, PAGE_BYTES, "ns", 0, 1))
    pool = torch.zeros(PAGES, PAGE_BYTES, dtype=torch.uint8)
    job = TransferJob(
        1,
        "R",
        list(range(PAGES)),
        list(range(PAGES)),
        fetch=[(i, "disk", key(i)) for i in range(PAGES)],
        recompute_s=recompute_s,
    )
    meta = KVBMWorkerMetadata()

    def ended():
        deadline = time.monotonic() + 60
        while not (ready := io.poll(meta)):
            assert time.monotonic() < deadline, "the fetch never ended"
            time.sleep(0.005)
        return ready

    try:
        if first_read_blocked_s is None:
            with mount.slow(blocked_s=0.3, open_s=0.05):
                io.fetch(job, pool)
                ready = ended()
        else:
            with mount.blocked():
                io.fetch(job, pool)
                time.sleep(first_read_blocked_s)
            ready = ended()
    finally:
        io.close()
    [(got, ok, reading, cut)] = ready
    assert got is job and ok and not reading
    return cut, pool, meta


def test_a_fetch_slower_than_recompute_is_cut_at_the_pages_landed(mount):
    pages = _pages(mount)
    # recomputing page i.. would take 10 ms a page: far below one slow read
    cut, pool, meta = _fetch(mount, [0.01 * (PAGES - i) for i in range(PAGES)])
    assert cut is not None and cut < PAGES // 2
    for i in range(cut):  # the pages landed are intact
        assert torch.equal(pool[i], pages[i])
    assert meta.bad_pages == []  # pages not read are not reported missing


def test_a_slow_first_read_alone_does_not_cut_a_fetch(mount):
    """The first read pays the tier's latency (here the mount blocks it
    0.3 s); the pages after it come fast. Paced from its first read, the
    fetch looked like 11 x 0.3 s against 0.6 s of recompute and was cut; its
    pace is taken after the first group, so it loads everything."""
    pages = _pages(mount)
    cut, pool, _ = _fetch(
        mount, [0.05 * (PAGES - i) for i in range(PAGES)], first_read_blocked_s=0.3
    )
    assert cut is None
    for i in range(PAGES):
        assert torch.equal(pool[i], pages[i])


def test_a_fetch_with_no_recompute_time_known_is_never_cut(mount):
    pages = _pages(mount)
    cut, pool, _ = _fetch(mount, [])
    assert cut is None
    for i in range(PAGES):
        assert torch.equal(pool[i], pages[i])


def test_the_worker_loads_the_landed_pages_and_reports_the_rest_as_load_errors(mount, harness):
    """Through KVBMWorker: the cut job's landed pages are moved into their
    engine blocks by NIXL, the others' blocks are load errors, and the
    scheduler is told where the load was cut."""
    h = harness()
    bb = h.lay.block_bytes()
    writer = DiskStore(str(mount.root), 64 << 20, bb, "ns", 0, 1)
    g = torch.Generator().manual_seed(12)
    pages = [torch.randint(0, 256, (bb,), dtype=torch.uint8, generator=g) for _ in range(PAGES)]
    for i, p in enumerate(pages):
        assert writer.put(key(i), p)
    writer.close()
    h.worker.add_tier(DiskStore(str(mount.path), 64 << 20, bb, "ns", 0, 1))
    blocks = list(range(10, 10 + PAGES))
    job = TransferJob(
        7,
        "R",
        blocks,
        list(range(PAGES)),
        fetch=[(i, "disk", key(i)) for i in range(PAGES)],
        recompute_s=[0.01 * (PAGES - i) for i in range(PAGES)],
    )
    with mount.slow(blocked_s=0.3, open_s=0.05):
        h.worker.start_loads(KVBMConnectorMetadata(loads=[job]))
        h.step_until(lambda: "R" in h.recving, timeout=60)
    [(req, cut)] = h.meta.loads_cut
    assert req == "R" and cut < PAGES // 2
    assert not h.meta.loads_failed
    assert h.worker.get_block_ids_with_load_errors() == set(blocks[cut:])
    for i in range(cut):
        assert torch.equal(h.lay.slot_bytes(blocks[i]), pages[i])
