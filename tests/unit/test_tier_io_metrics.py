"""What the worker reports for the metrics: each page write and each load's
reads from a lower tier timed, and the disk tier's bytes used and capacity;
turned into tier-labelled series by the scheduler side. Real DiskStore, real
TierIO threads, real files."""

from __future__ import annotations

import time
from collections import Counter

import torch

from helpers.tier_pages import SMALL, key, page, phys
from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob
from vllm_kvbm.metrics import KVBMStats
from vllm_kvbm.scheduler.tier_policy import LowerTiers
from vllm_kvbm.tiers.disk.store import DiskStore
from vllm_kvbm.worker.tier_io import TierIO

CAPACITY = 64 << 20


def _until(io: TierIO, meta: KVBMWorkerMetadata, done, what: str) -> list:
    deadline, ready = time.monotonic() + 30, []
    while True:
        ready += io.poll(meta)
        if done(ready):
            return ready
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_writes_reads_and_disk_usage_reach_the_worker_metadata(tmp_path):
    io = TierIO()
    io.add(DiskStore(str(tmp_path / "disk"), CAPACITY, SMALL, "ns", 0, 1))
    try:
        meta = KVBMWorkerMetadata()
        for i in range(3):
            io.spill(["disk"], [(key(i), page(i, SMALL))])
        _until(
            io,
            meta,
            lambda _: meta.tier_events[("disk", "stored", 0)] == 3,
            "the spills never finished",
        )
        assert [tier for tier, _ in meta.tier_write_seconds] == ["disk"] * 3
        assert all(seconds > 0 for _, seconds in meta.tier_write_seconds)
        [((tier, rank), (used, capacity))] = meta.tier_usage.items()
        assert (tier, rank, capacity) == ("disk", 0, CAPACITY)
        assert 3 * SMALL <= used <= 3 * phys(SMALL) + 3 * 4096  # as its LRU charges pages

        meta = KVBMWorkerMetadata()
        pool = torch.zeros(3, SMALL, dtype=torch.uint8)
        job = TransferJob(
            1, "R", [0, 1, 2], [0, 1, 2], fetch=[(i, "disk", key(i)) for i in range(3)]
        )
        io.fetch(job, pool)
        [(got, ok, _, _)] = _until(io, meta, bool, "the fetch never ended")
        assert got is job and ok
        [(tier, seconds)] = meta.tier_read_seconds  # one load's reads, timed once
        assert tier == "disk" and seconds > 0
        assert meta.tier_usage == {}  # unchanged since last reported
        assert not KVBMWorkerMetadata(tier_read_seconds=[("disk", 0.1)]).is_empty()
    finally:
        io.close()


def test_the_scheduler_side_labels_them_by_tier():
    """Worker events per tier become the tier's series; the internal totals
    the scheduler keeps stay the sum over tiers."""
    stats = KVBMStats()
    stats.declare(["host", "disk", "remote"])
    stats.take()
    LowerTiers([]).record(
        Counter(
            {
                ("disk", "stored", 0): 2,
                ("disk", "corrupt", 0): 1,
                ("remote", "corrupt", 0): 3,
                ("remote", "error", 0): 1,
            }
        ),
        stats,
    )
    counters = stats.take()["counters"]
    assert counters == {
        "offload_blocks_h2d": 2,
        "checksum_failures@disk": 1,
        "checksum_failures@remote": 3,
        "tier_read_errors@remote": 1,
    }
    assert stats.total["checksum_failures"] == 4


def test_a_stores_own_counts_become_the_peer_series():
    """TierStore.counts as the workers report them: the pool's peer-directory
    entries (running totals, per rank: only what grew is counted), whether
    kvbm-pool answers the attached ranks, and the peer tier's quarantined
    landing slots (the fullest rank's)."""
    from vllm.v1.outputs import KVConnectorOutput

    from helpers.scheduler_harness import kvbm, make_scheduler

    k = kvbm(make_scheduler())
    assert k.stats.gauges["peer_quarantined_slots"] == 0  # exported from the start

    def report(counts):
        k.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=KVBMWorkerMetadata(tier_counts=counts))
        )

    pool = {"written": 5, "deleted": 1, "dropped": 2, "failed": 0}
    report({("pool", 0): pool, ("peer", 0): {"quarantined": 2}, ("peer", 1): {"quarantined": 3}})
    report({("pool", 0): {**pool, "written": 7, "failed": 4}, ("peer", 1): {"quarantined": 0}})
    assert k.stats.total["peer_directory_entries"] == 7 + 1 + 2 + 4
    counters = k.stats.take()["counters"]
    assert {key: n for key, n in counters.items() if key.startswith("peer_directory_entries")} == {
        "peer_directory_entries@written": 7,
        "peer_directory_entries@deleted": 1,
        "peer_directory_entries@dropped": 2,
        "peer_directory_entries@failed": 4,
    }
    assert k.stats.gauges["peer_quarantined_slots"] == 2  # rank 0's, rank 1's back to 0
    assert "tier_up@pool" not in k.stats.gauges  # not attached to kvbm-pool: no series
    # attached ranks: whether their kvbm-pool answers, 0 while any rank's does not
    report({("pool", 0): {**pool, "up": 1}, ("pool", 1): {"up": 0}})
    assert k.stats.gauges["tier_up@pool"] == 0
    report({("pool", 1): {"up": 1}})
    assert k.stats.gauges["tier_up@pool"] == 1
