"""Loads longer than the host tier: disk pages streamed through the worker's
staging slots into the engine's blocks (real worker, real NIXL, real disk
tier), and the scheduler side planning them on vLLM's real Scheduler."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from test_worker_unit import NB, SLOTS, gen, harness  # noqa: F401 (fixtures)
from helpers.tier_pages import disk_store_for, key
from vllm_kvbm.messages import STREAM, KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.disk.store import DiskStore


def disk_with_pages(h, tmp_path, n: int, first: int = 0):
    """A real disk tier on ``h``'s worker holding ``n`` distinct pages."""
    bb = h.lay.block_bytes()
    store = DiskStore(str(tmp_path), 64 << 20, bb, "ns", 0, 1)
    h.worker.add_tier(store)
    g = torch.Generator().manual_seed(7)
    pages = {}
    for i in range(first, first + n):
        pages[key(i)] = torch.randint(0, 256, (bb,), dtype=torch.uint8, generator=g)
        assert store.put(key(i), pages[key(i)])
    return pages


def test_a_load_longer_than_the_staging_slots_streams_every_page(harness, tmp_path):
    h = harness()
    staging = h.worker._staging
    n = 3 * staging.count + 5  # several rounds through the staging slots
    pages = disk_with_pages(h, tmp_path, n)
    blocks = list(range(10, 10 + n))
    # Two pages promoted into host slots, the rest streamed.
    slots = [5, 6] + [STREAM] * (n - 2)
    job = TransferJob(1, "R", blocks, slots, fetch=[(i, "disk", key(i)) for i in range(n)])
    for b in blocks:
        h.lay.zero_block(b)
    h.worker.start_loads(KVBMConnectorMetadata(loads=[job]))
    h.step_until(lambda: "R" in h.recving, timeout=60)
    assert h.recving == ["R"] and not h.meta.loads_failed
    assert h.worker.get_block_ids_with_load_errors() == set()
    for i, b in enumerate(blocks):
        assert torch.equal(h.lay.slot_bytes(b), pages[key(i)]), i
    assert h.meta.bytes_loaded == n * h.lay.block_bytes()  # reported once, as one load
    assert h.meta.tier_events[("disk", "ok", 0)] == n
    # The promoted pages are in their host slots; staging is free again.
    assert torch.equal(h.pool[5], pages[key(0)]) and torch.equal(h.pool[6], pages[key(1)])
    assert staging.free == staging.count and not h.worker._parts
    assert all(s >= SLOTS for s in range(staging.first, staging.first + staging.count))


def test_a_missing_streamed_page_fails_the_whole_load_after_its_parts_end(harness, tmp_path):
    h = harness()
    staging = h.worker._staging
    n = 2 * staging.count
    pages = disk_with_pages(h, tmp_path, n)
    missing = n // 2 + 1
    h.worker.tier_io.tiers["disk"].remove(key(missing))
    blocks = list(range(100, 100 + n))
    job = TransferJob(2, "R", blocks, [STREAM] * n, fetch=[(i, "disk", key(i)) for i in range(n)])
    h.worker.start_loads(KVBMConnectorMetadata(loads=[job]))
    h.step_until(lambda: "R" in h.recving, timeout=60)
    h.step()
    assert h.recving == ["R"]  # reported once
    assert h.meta.loads_failed == {"R": 1}
    # Every block of the load is recomputed, whatever part failed.
    assert h.worker.get_block_ids_with_load_errors() == set(blocks)
    assert ("disk", key(missing)) in h.meta.bad_pages
    assert staging.free == staging.count and not h.worker._parts
    assert len(pages) == n


def test_two_streamed_loads_share_the_staging_slots(harness, tmp_path):
    h = harness()
    staging = h.worker._staging
    n = 2 * staging.count
    pages = disk_with_pages(h, tmp_path, 2 * n)
    jobs = [
        TransferJob(
            3 + j,
            f"R{j}",
            list(range(j * n, (j + 1) * n)),
            [STREAM] * n,
            fetch=[(i, "disk", key(j * n + i)) for i in range(n)],
        )
        for j in range(2)
    ]
    h.worker.start_loads(KVBMConnectorMetadata(loads=jobs))
    h.step_until(lambda: {"R0", "R1"} <= set(h.recving), timeout=60)
    assert not h.meta.loads_failed
    for j in range(2):
        for i in range(n):
            assert torch.equal(h.lay.slot_bytes(j * n + i), pages[key(j * n + i)])
    assert staging.free == staging.count
    assert 2 * n <= NB


# ---- the scheduler side, on vLLM's real Scheduler ---------------------------------


def test_scheduler_loads_a_prefix_longer_than_the_host_tier(tmp_path):
    from helpers.scheduler_harness import BLOCK, admit, kvbm, make_request, make_scheduler, step
    from helpers.scheduler_harness import keys_of, run_until_done, tokens
    from helpers.tier_pages import put_on_disk_where_the_scheduler_sees

    sched = make_scheduler(host_blocks=4, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    prompt = tokens(10 * BLOCK + 3, 31)
    keys = keys_of(sched, prompt)
    put_on_disk_where_the_scheduler_sees(k, tmp_path, keys)
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    [load] = meta.loads
    assert len(load.block_ids) == 10  # all of it, with a 4-block host tier
    promoted = [s for s in load.slots if s != STREAM]
    assert len(promoted) == 4 and load.slots.count(STREAM) == 6
    assert [key_ for _, _, key_ in load.fetch] == keys
    assert k.stats.total["matched_tokens_disk"] == 10 * BLOCK
    step(sched, finished_recving=[req.request_id])
    assert k.stats.total["onboard_blocks_d2d"] == 10
    assert k.stats.total["onboard_blocks_h2d"] == 10
    assert sum(k.host.is_ready(key_) for key_ in keys) == 4  # the promoted ones
    run_until_done(sched, req.request_id)


# ---- a frozen filesystem: the read deadline ---------------------------------------


@pytest.mark.parametrize("into", ["host slots", "staging slots"])
def test_a_load_from_a_frozen_disk_fails_at_its_deadline_and_holds_its_slots(harness, ext4, into):
    """The disk's filesystem is frozen (fsfreeze) under a load of promoted
    pages (read into host slots) or streamed ones (read into staging slots):
    the read blocks in the kernel (its LRU touch: the pages were last read
    over a minute ago, so it updates their inode), the load is reported
    failed after tier_read_timeout_s (vLLM recomputes), and the slots the
    blocked read writes into are held (host slots from the host tier, via
    the worker metadata) or kept back (staging slots) until it ends; reads
    queued behind it are cancelled. After the thaw the slots are released."""
    import time

    h = harness()
    staging = h.worker._staging
    n = staging.count
    disk_with_pages(h, ext4.path, n)
    old = time.time() - 3600
    for page_file in glob.glob(os.path.join(ext4.path, "*.pt")):
        os.utime(page_file, (old, old))
    h.worker.tier_io.read_timeout_s = 1.0
    blocks = list(range(10, 10 + n))
    slots = list(range(n)) if into == "host slots" else [STREAM] * n
    job = TransferJob(1, "R", blocks, slots, fetch=[(i, "disk", key(i)) for i in range(n)])
    ext4.freeze()
    started = time.monotonic()
    h.worker.start_loads(KVBMConnectorMetadata(loads=[job]))
    h.step_until(lambda: "R" in h.recving, timeout=20)
    took = time.monotonic() - started
    print(f"load reported failed after {took:.2f} s (deadline 1 s)")
    assert 1.0 <= took < 5.0
    assert h.meta.loads_failed == {"R": 1}
    assert h.worker.get_block_ids_with_load_errors() == set(blocks)
    assert h.meta.tier_events[("disk", "error", 0)] >= 1
    assert not h.meta.slots_released
    if into == "host slots":
        # The fetch whose read blocked: every slot it may still write.
        assert set(h.meta.slots_held) == set(range(n)) and staging.free == staging.count
    else:
        # The first chunk blocked (held); the second never started (given back).
        assert not h.meta.slots_held and staging.free == staging.count // 2
    ext4.thaw()
    h.step_until(
        lambda: (
            staging.free == staging.count and set(h.meta.slots_released) == set(h.meta.slots_held)
        ),
        timeout=20,
    )
    assert not h.worker._parts and not h.worker._staging_reading
