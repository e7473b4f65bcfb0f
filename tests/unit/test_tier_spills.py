"""Write-through spills (host slot -> disk) leave the engine thread alone:
the slots are copied out on the spill copy thread, and the job is reported
copied (its slots free for reuse) only once every copy ended. Real
DiskStore, real TierIO threads, real files."""

from __future__ import annotations

import threading
import time

import torch

from helpers.tier_pages import SMALL, key, page
from test_tier_io_metrics import _until
from vllm_kvbm.messages import KVBMWorkerMetadata
from vllm_kvbm.tiers.disk.store import DiskStore
from vllm_kvbm.worker.tier_io import TierIO


def test_slots_are_copied_off_the_caller_and_reported_once_copied(tmp_path):
    """While the copy thread is busy the spill returns at once, nothing is
    copied or reported; then each page is written as its slot held when
    copied, and the job is reported copied once, after the copies."""
    io = TierIO()
    store = DiskStore(str(tmp_path / "disk"), 64 << 20, SMALL, "ns", 0, 1)
    io.add(store)
    slots = torch.stack([page(i, SMALL) for i in range(4)])
    held = threading.Event()
    try:
        assert io._copier is not None
        busy = io._copier.submit(held.wait, 10)  # the copy thread is taken
        started = time.perf_counter()
        io.spill(["disk"], [(key(i), slots[i]) for i in range(4)], job_id=7)
        assert time.perf_counter() - started < 1.0
        meta = KVBMWorkerMetadata()
        io.poll(meta)
        assert not meta.spills_done  # the slots are not free yet
        assert not any(store.contains(key(i)) for i in range(4))
        assert io.queues["disk"].queued == 0  # not even admitted to the writers yet
        held.set()
        busy.result(10)
        _until(io, meta, lambda _: meta.spills_done[7] == 1, "never reported copied")
        assert dict(meta.spills_done) == {7: 1}
        slots.zero_()  # the slots reused: the writes hold their own copies
        _until(
            io,
            meta,
            lambda _: meta.tier_events[("disk", "stored", 0)] == 4,
            "the writes never ended",
        )
        out = torch.empty(SMALL, dtype=torch.uint8)
        for i in range(4):
            assert store.get_into(key(i), out) == "ok" and torch.equal(out, page(i, SMALL)), i
        assert dict(meta.spills_done) == {7: 1}  # reported once
    finally:
        held.set()
        io.close()


def test_a_burst_waits_for_room_in_the_write_queue_then_drops_what_finds_none(tmp_path):
    """A full write queue makes the copy thread wait for a place (the slots
    stay pinned) rather than drop at once: pages that get a place in time
    are written; those that do not (the tier's writers stuck) are dropped
    (no copy), reported as pages the tier lacks, and the job is still
    reported copied. A tier that gives no place back is not waited for
    again, however long a spill may wait."""
    io = TierIO(write_queue_pages=2)
    store = DiskStore(str(tmp_path / "disk"), 64 << 20, SMALL, "ns", 0, 1)
    io.add(store)
    io.spill_wait_s = 0.5
    held = threading.Event()
    try:
        # every writer thread taken: the two queued writes cannot start
        writers = [io._writer["disk"].submit(held.wait, 10) for _ in range(store.write_inflight)]
        io.spill(["disk"], [(key(i), page(i, SMALL)) for i in range(5)], job_id=3)
        meta = KVBMWorkerMetadata()
        _until(io, meta, lambda _: meta.spills_done[3] == 1, "never reported copied")
        assert io.queues["disk"].queued == 2  # the first two, waiting for a writer
        assert meta.tier_events[("disk", "dropped", 0)] == 3
        assert sorted(meta.removed_pages) == [("disk", key(i)) for i in range(2, 5)]
        io.spill_wait_s = 30  # the stalled tier is not waited for: dropped at once
        io.spill(["disk"], [(key(i), page(i, SMALL)) for i in range(5, 7)], job_id=5)
        _until(io, meta, lambda _: meta.spills_done[5] == 1, "waited on a stalled tier")
        assert meta.tier_events[("disk", "dropped", 0)] == 5
        held.set()
        for w in writers:
            w.result(10)
        _until(
            io,
            meta,
            lambda _: meta.tier_events[("disk", "stored", 0)] == 2,
            "the two writes never ended",
        )
        assert store.contains(key(0)) and store.contains(key(1)) and not store.contains(key(2))

        # With room, a burst larger than the queue waits and is written whole.
        io.spill_wait_s = 30  # ends as each place comes free
        io.spill(["disk"], [(key(i), page(i, SMALL)) for i in range(10, 18)], job_id=4)
        _until(
            io,
            meta,
            lambda _: meta.tier_events[("disk", "stored", 0)] == 10,
            "the burst was not written whole",
        )
        assert meta.spills_done[4] == 1 and meta.tier_events[("disk", "dropped", 0)] == 5
        assert io.queues["disk"].peak == 2
    finally:
        held.set()
        io.close()
