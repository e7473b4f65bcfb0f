"""TierIO, the worker's lower-tier I/O, on real stores: reads never queue
behind writes, and each tier's write queue is bounded (a full queue drops the
write, counts it, and the scheduler writes the page again when next reused).

Slowness is real: a real ext4 frozen with fsfreeze under the disk's writes, and a
real LMCache server whose write connection stalls (a relay process in front
of it, SIGSTOPped for that connection only: tests/helpers/tcp_relay.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import MiB, SMALL, key, page  # noqa: E402
from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob  # noqa: E402
from vllm_kvbm.worker.tier_io import TierIO  # noqa: E402

# Reads and writes are timed against the stores' timeouts (3 s) while a
# connection stalls: a busy second worker can stretch a read past that.
pytestmark = pytest.mark.timing


def fetch_one(
    io: TierIO, tier: str, k: bytes, pool: torch.Tensor, slot: int, meta, timeout: float = 20.0
) -> bool:
    """Fetches ``k`` into ``pool[slot]``, polling as the worker does each step."""
    io.fetch(TransferJob(1, "req", [0], [slot], fetch=[(0, tier, k)]), pool)
    deadline = time.monotonic() + timeout
    while True:
        ready = io.poll(meta)
        if ready:
            [(_, ok, _, _)] = ready
            return ok
        assert time.monotonic() < deadline, "the fetch never finished"
        time.sleep(0.001)


def wait_writes(io: TierIO, meta, tier: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while meta.tier_events[(tier, "stored", 0)] + meta.tier_events[(tier, "refused", 0)] < n:
        assert time.monotonic() < deadline, "the writes never finished"
        io.poll(meta)
        time.sleep(0.01)


def test_a_disk_fetch_does_not_wait_for_the_disks_writes_which_run_several_at_once(ext4):
    """The disk's filesystem is frozen (fsfreeze: every write blocks in the
    kernel) under 64 spills: its store.write_inflight writer threads all
    block, one page each, the rest stay queued; a fetch of a page in the
    page cache, asked after them, completes while none has been written. After
    the thaw every spilled page lands and reads back as spilled."""
    import threading

    from vllm_kvbm.tiers.disk.store import DiskStore

    n = 64
    store = DiskStore(str(ext4.path), 128 * MiB, SMALL, "ns-io", 0, 1)
    assert store.write_inflight == 4
    io = TierIO(write_queue_pages=n)
    io.add(store)
    meta = KVBMWorkerMetadata()

    def writers() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("kvbm-disk-write")}

    try:
        assert store.put(key(1000), page(1000, SMALL))
        ext4.freeze()
        for i in range(n):
            io.spill(["disk"], [(key(i), page(i, SMALL))])
        deadline = time.monotonic() + 10
        while len(writers()) < store.write_inflight:  # each blocked on its own page
            assert time.monotonic() < deadline, f"writers: {writers()}"
            time.sleep(0.01)
        pool = torch.zeros(1, SMALL, dtype=torch.uint8)
        assert fetch_one(io, "disk", key(1000), pool, 0, meta)
        assert torch.equal(pool[0], page(1000, SMALL))
        assert io.queues["disk"].queued == n and not meta.tier_events[("disk", "stored", 0)]
        assert len(writers()) == store.write_inflight
        ext4.thaw()
        wait_writes(io, meta, "disk", n)
        assert meta.tier_events[("disk", "stored", 0)] == n
        assert io.queues["disk"].queued == 0 and not meta.tier_events[("disk", "dropped", 0)]
        out = torch.empty(SMALL, dtype=torch.uint8)
        for i in range(n):
            assert store.get_into(key(i), out) == "ok" and torch.equal(out, page(i, SMALL)), i
    finally:
        ext4.thaw()
        io.close()


def test_a_stalled_remote_fills_its_write_queue_drops_and_still_reads(relay):
    """The remote's write connection stalls (and so does any new one): its
    writer waits on the first spill, the queue holds 4, the other 6 spills
    wait for a place for ``spill_wait_s`` and are dropped (no copy), counted
    and reported as pages the tier lacks; a fetch from the same tier answers
    meanwhile on its read connection."""
    from vllm_kvbm.tiers.lm.store import RemoteStore

    timeout = 3.0
    store = RemoteStore(relay.url, SMALL, "ns-io", 0, 1, timeout_s=timeout, retry_interval_s=0.2)
    io = TierIO(write_queue_pages=4)
    io.add(store)
    try:
        assert store.put(key(100), page(100, SMALL))
        relay.freeze(store._writes.conn.sock)
        relay.freeze_new_connections()
        io.spill_wait_s = 0.5
        for i in range(10):
            io.spill(["remote"], [(key(i), page(i, SMALL))])
        deadline = time.monotonic() + 10
        while io.queues["remote"].queued < 4:  # taken on the spill copy thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert io.queues["remote"].queued == 4  # the writer is stuck on the first
        meta = KVBMWorkerMetadata()
        pool = torch.zeros(2, SMALL, dtype=torch.uint8)
        assert fetch_one(io, "remote", key(100), pool, 1, meta)
        assert torch.equal(pool[1], page(100, SMALL))
        deadline = time.monotonic() + 10
        while meta.tier_events[("remote", "dropped", 0)] < 6:
            assert time.monotonic() < deadline, meta.tier_events
            io.poll(meta)
            time.sleep(0.01)
        assert sorted(meta.removed_pages) == [("remote", key(i)) for i in range(4, 10)]
        assert meta.tier_events[("remote", "ok", 0)] == 1 and not meta.is_empty()
    finally:
        relay.thaw()
    try:
        wait_writes(io, meta, "remote", 4, timeout=30)
        assert io.queues["remote"].peak == 4 and io.queues["remote"].queued == 0
        assert meta.tier_events[("remote", "dropped", 0)] == 6  # nothing else dropped
    finally:
        io.close()


def test_dropped_writes_reach_the_scheduler_and_are_written_again_when_reused(relay):
    """Through the real worker and scheduler: a request's three blocks are
    spilled to a remote tier whose write connection stalled, with room for
    one write. The worker still reports every spill copied once the other
    two waited their ``spill_wait_s`` for room (the host slots are
    unpinned), the scheduler counts two drops, and when the prompt is reused
    from the host tier exactly the two dropped blocks are spilled again."""
    from helpers.scheduler_harness import BLOCK, kvbm, make_request, make_scheduler, step
    from helpers.scheduler_harness import keys_of, tokens
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_kvbm.messages import KVBMConnectorMetadata
    from vllm_kvbm.tiers.lm.store import RemoteStore
    from vllm_kvbm.worker.worker import KVBMWorker

    sched = make_scheduler(host_blocks=16, remote_url=relay.url, remote_timeout_s=3.0)
    k = kvbm(sched)
    info = k.info
    worker = KVBMWorker(info, 16, "UCX", "kvbm-tier-io-test", tier_write_queue_pages=1)
    # Spills read host slots only: plain memory is all they need (no NIXL).
    worker.host_pool = torch.zeros(16, info.block_bytes, dtype=torch.uint8)
    store = RemoteStore(
        relay.url, info.block_bytes, info.tier_namespace, 0, 1, timeout_s=3.0, retry_interval_s=0.2
    )
    worker.add_tier(store)
    try:
        prompt = tokens(3 * BLOCK + 1, 21)
        keys = keys_of(sched, prompt)
        req = make_request(prompt, max_tokens=1)
        sched.add_request(req)
        spills = []
        deadline = time.monotonic() + 20  # its lookup asks the server off the scheduler thread
        while not spills:
            assert time.monotonic() < deadline, "the blocks were never spilled"
            _, meta, _ = step(sched, complete=True)
            spills += meta.spills
            time.sleep(0.01)
        assert [key for s in spills for key in s.keys] == keys[:3]
        assert all(s.tiers == ["remote"] for s in spills)
        assert all(k.host._entries[key].pins == 1 for key in keys[:3])

        relay.freeze(store._writes.conn.sock)
        worker.start_stores(KVBMConnectorMetadata(spills=spills))
        wmeta = KVBMWorkerMetadata()
        deadline = time.monotonic() + 10  # the slots are copied out on the spill copy thread
        while wmeta.spills_done != Counter({s.job_id: 1 for s in spills}):
            assert time.monotonic() < deadline, f"spills reported: {wmeta.spills_done}"
            worker.get_finished(set())
            wmeta = wmeta.aggregate(worker.build_worker_meta() or KVBMWorkerMetadata())
            time.sleep(0.01)
        assert wmeta.tier_events[("remote", "dropped", 0)] == 2
        k.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wmeta))
        assert k.stats.total["tier_write_drops"] == 2
        assert all(k.host._entries[key].pins == 0 for key in keys[:3])  # pins released

        # The prompt again: a host-tier hit, and the loaded blocks are
        # admitted for write-through again: only the two dropped ones.
        for _ in range(50):
            if req.request_id not in sched.requests:
                break
            step(sched, complete=True)
        assert sched.reset_prefix_cache()  # vLLM forgets the prompt; the host tier does not
        again = make_request(prompt, max_tokens=1)
        sched.add_request(again)
        respilled = []
        deadline = time.monotonic() + 20
        while again.request_id in sched.requests:
            assert time.monotonic() < deadline, "the second request never finished"
            _, meta, _ = step(sched, complete=True)
            respilled += meta.spills
            time.sleep(0.01)
        assert k.stats.total["onboard_blocks_h2d"] >= 3  # it was a host hit
        assert sorted(key for s in respilled for key in s.keys) == sorted(keys[1:3])
        assert all(s.tiers == ["remote"] for s in respilled)
    finally:
        relay.thaw()
        worker.shutdown()


def test_a_refused_write_is_reported_as_a_page_the_tier_lacks(tmp_path):
    """A disk whose filesystem is full refuses writes: each refused page is
    counted and reported like a page the tier does not have, so the
    scheduler's write-through bookkeeping forgets it and writes it again
    when the block is next reused (it stayed marked written before)."""
    from helpers.system import mount_tmpfs, umount
    from vllm_kvbm.tiers.disk.store import DiskStore

    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=4m")
    try:
        store = DiskStore(str(mnt), 64 * MiB, MiB, "ns-io", 0, 1)
        io = TierIO()
        io.add(store)
        try:
            meta = KVBMWorkerMetadata()
            for i in range(6):
                io.spill(["disk"], [(key(i), page(i, MiB))])
            wait_writes(io, meta, "disk", 6)
            stored = meta.tier_events[("disk", "stored", 0)]
            refused = meta.tier_events[("disk", "refused", 0)]
            assert stored >= 1 and refused >= 1 and stored + refused == 6
            gone = {k for tier, k in meta.removed_pages if tier == "disk"}
            assert gone == {key(i) for i in range(6) if not store.contains(key(i))}
            assert len(gone) == refused
        finally:
            io.close()
    finally:
        umount(mnt)
