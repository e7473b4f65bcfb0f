"""Peer pages READ straight into host slots, and what guards those slots.

Real NIXL agents in real processes as in test_peer_reads: the serving peer
is helpers/pool_peer.py, this process writes its pool file and reads it
back through a PeerStore whose host memory is registered (``reads_into``),
alone and under TierIO as a worker fetches a load. The faults are real: a
page damaged in the peer's pool, and the peer stopped (SIGSTOP) mid-read
over TCP, where a READ past its deadline still lands after SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from helpers import pool_peer
from helpers.tier_pages import key, page
from test_peer_reads import PAGE, TRANSPORTS, read_until, reader, transport, writer  # noqa: F401
from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tools.server import free_port, freeze_process
from vllm_kvbm.worker.tier_io import TierIO

pytestmark = pytest.mark.timeout(300)


def _job(n: int, endpoint: str) -> TransferJob:
    return TransferJob(
        1,
        "R",
        list(range(n)),
        list(range(n)),
        fetch=[(i, "peer", key(i + 1)) for i in range(n)],
        peer=endpoint,
    )


def _poll_ready(io: TierIO, meta, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (ready := io.poll(meta)):
        assert time.monotonic() < deadline, "the fetch never ended"
        time.sleep(0.01)
    return ready


def test_pages_land_in_place_in_registered_memory(shm, procs, transport):
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS[transport])
    procs.append(proc)
    r = reader()
    host = torch.zeros(7, PAGE, dtype=torch.uint8)
    try:
        r.reads_into(host)
        for i in range(1, 7):
            assert w.put(key(i), page(i, PAGE))
        # damaged in the peer's pool: refused where it landed (checked on the
        # helper thread: a second batch follows the first)
        slot, _ = layout.find(
            w.pool.view, w.pool.geometry, layout.table_key(w._codec.names, key(2))
        )
        w.pool.view[w.pool.geometry.slot_off(slot) + HEADER_BYTES + 100] ^= 0xFF
        endpoint = f"tcp://127.0.0.1:{port}"
        items = [(key(i), host[i - 1]) for i in range(1, 8)]
        assert r.get_many_into(items, endpoint=endpoint) == ["ok", "corrupt"] + ["ok"] * 4 + [
            "miss"
        ]
        assert all(torch.equal(host[i], page(i + 1, PAGE)) for i in (0, 2, 3, 4, 5))
        assert not r._checks
        # the payloads went to the host slots, not through the landing slots
        land = r.landing
        for s in range(land.count):
            off = land.page_off(s) + HEADER_BYTES
            assert not any(land.view[off : off + 4096])
        # memory not registered still reads (through a landing slot)
        other = torch.zeros(PAGE, dtype=torch.uint8)
        assert r.get_many_into([(key(3), other)], endpoint=endpoint) == ["ok"]
        assert torch.equal(other, page(3, PAGE))
    finally:
        r.close()
        w.close()


def test_a_corrupt_page_read_in_place_fails_its_fetch_and_frees_its_slots(shm, procs):
    """Damaged in the peer's pool: read into its host slot, refused there;
    the load fails (vLLM recomputes) with nothing held, the page named bad."""
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS["default"])
    procs.append(proc)
    io = TierIO(read_timeout_s=20.0)
    io.add(reader(), host := torch.zeros(2, PAGE, dtype=torch.uint8))
    meta = KVBMWorkerMetadata()
    try:
        for i in (1, 2):
            assert w.put(key(i), page(i, PAGE))
        slot, _ = layout.find(
            w.pool.view, w.pool.geometry, layout.table_key(w._codec.names, key(2))
        )
        w.pool.view[w.pool.geometry.slot_off(slot) + HEADER_BYTES + 100] ^= 0xFF
        io.fetch(_job(2, f"tcp://127.0.0.1:{port}"), host)
        [(job, ok, reading, cut)] = _poll_ready(io, meta)
        assert (ok, reading, cut) == (False, False, None)  # failed; its slots free at once
        assert meta.bad_pages == [("peer", key(2))]
        assert meta.tier_events[("peer", "corrupt", 0)] == 1
        assert meta.tier_events[("peer", "ok", 0)] == 1
        assert torch.equal(host[0], page(1, PAGE))
        assert io.tiers["peer"].landing.quarantined_dests == 0
    finally:
        io.close()
        w.close()


def test_a_late_read_in_place_holds_its_slots_until_it_ends(shm, procs, monkeypatch):
    """Over TCP a stopped peer stalls the READ past its deadline: the pages
    are "late", their host slots quarantined. Under TierIO the load fails
    at once (vLLM recomputes) but its slots stay held (never reused, never
    onboarded) while the peer is stopped, and come back only after SIGCONT
    lets the READ end."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS["tcp"])
    procs.append(proc)
    endpoint = f"tcp://127.0.0.1:{port}"
    store = reader(read_timeout_s=1.0, retry_s=0.3)
    host = torch.zeros(2, PAGE, dtype=torch.uint8)
    io = TierIO(read_timeout_s=20.0)
    io.add(store, host)
    meta = KVBMWorkerMetadata()
    try:
        assert w.put(key(1), page(1, PAGE)) and w.put(key(2), page(2, PAGE))
        # connected first, on this thread: the store's first call registers the
        # host memory on the read thread, so wait for it there
        io._reader["peer"].submit(lambda: None).result(30)
        items = [(key(1), host[0]), (key(2), host[1])]
        assert read_until(store, items, endpoint, ["ok", "ok"]) == ["ok", "ok"]
        settle = time.monotonic() + 15
        while store.landing.quarantined and time.monotonic() < settle:
            store.take_ended_writes()  # a slow first read: its late slots back
            time.sleep(0.05)
        assert store.landing.quarantined == 0
        host.zero_()
        # stopped between the READ of the sets (which a stopped peer would
        # stall first) and the READ of the pages into the host slots
        xfer = store._xfer

        def stop_before_pages(peer, slots, deadline, spans, dests=None):
            if dests:
                freeze_process(proc, "the peer")
            return xfer(peer, slots, deadline, spans, dests)

        monkeypatch.setattr(store, "_xfer", stop_before_pages)
        io.fetch(_job(2, endpoint), host)
        [(job, ok, reading, cut)] = _poll_ready(io, meta)
        assert (ok, reading, cut) == (False, True, None)  # failed, its slots held
        # TierIO's first group is one page: that READ is late, the next not tried
        assert store.landing.quarantined_dests == 1
        assert [a for f in io._fetching for _, a in f.late] == [host[0].data_ptr()]
        assert meta.tier_events[("peer", "error", 0)] == 2
        hold_until = time.monotonic() + 1.5  # still stopped: nothing ends
        while time.monotonic() < hold_until:
            assert io.poll(meta) == [] and io.take_ended() == []
            time.sleep(0.02)
        assert store.landing.quarantined_dests == 1
        os.killpg(proc.pid, signal.SIGCONT)
        ended, deadline = [], time.monotonic() + 20
        while not ended and time.monotonic() < deadline:
            io.poll(meta)
            ended = io.take_ended()
            time.sleep(0.02)
        assert ended == [job]  # now its slots may be reused
        assert store.landing.quarantined_dests == 0 and not io._fetching
    finally:
        io.close()
        w.close()
