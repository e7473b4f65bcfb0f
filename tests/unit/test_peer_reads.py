"""Reading a peer's pool through real NIXL agents in real processes.

The serving peer is a process of its own (helpers/pool_peer.py: a pool file
in /dev/shm and a PeerServer); this test process writes pages into the same
file (shared memory: the peer's pages) and reads them back through a
PeerStore, as another machine's worker would, with UCX over TCP
(``UCX_TLS=tcp``, asynchronous READs) and with UCX's default (on one machine:
cma, copied inside ``transfer()``). Faults are real: the slot rewritten
while it is read, the peer stopped (SIGSTOP) and killed (SIGKILL) mid-read,
and restarted at the same endpoint.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from helpers import pool_peer
from helpers.tier_pages import key, page
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.peer.store import PeerStore
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.store import PoolStore
from vllm_kvbm.tools.server import free_port, freeze_process

pytestmark = pytest.mark.timeout(300)

PAGE = 1 << 20  # ~1 ms per page over TCP here: a read is in flight long enough to hit
NS, SECRET = "ns-peer", b"k" * 32
TRANSPORTS = {"tcp": {"UCX_TLS": "tcp"}, "default": {}}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request, monkeypatch):
    """UCX's transport for this test's agents: read when an agent is created."""
    for name, value in TRANSPORTS[request.param].items():
        monkeypatch.setenv(name, value)
    if not TRANSPORTS[request.param]:
        monkeypatch.delenv("UCX_TLS", raising=False)
    return request.param


def codec(layout_fp: str = "L") -> PageCodec:
    return PageCodec(NS, PAGE, SECRET, layout=layout_fp)


def writer(shm: str, pages: int) -> PoolStore:
    """This process's store on the peer's pool file (the same shared memory)."""
    return PoolStore.open(pool_peer.pool_spec(shm, PAGE, pages, NS), codec())


def reader(layout_fp: str = "L", **kw) -> PeerStore:
    spec = pool_peer.pool_spec("/nonexistent", PAGE, 1, NS, layout_fp)
    kw.setdefault("read_timeout_s", 1.0)
    kw.setdefault("retry_s", 0.5)
    return PeerStore(codec(layout_fp), 0, 1, spec.scope_digest, spec.name, **kw)


def outs(n: int) -> list[torch.Tensor]:
    return [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(n)]


def read_until(store, items, endpoint, want, timeout=15.0):
    """Reads until the statuses are ``want`` (a peer marked down is asked
    again after retry_s); the last statuses."""
    deadline = time.monotonic() + timeout
    while True:
        got = store.get_many_into(items, endpoint=endpoint)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_pages_read_from_a_peer_are_verified(shm, procs, transport):
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS[transport])
    procs.append(proc)
    r = reader()
    try:
        for i in (1, 2, 3):
            assert w.put(key(i), page(i, PAGE))
        out = outs(4)
        endpoint = f"tcp://127.0.0.1:{port}"
        got = r.get_many_into([(key(i), o) for i, o in zip((1, 2, 3, 4), out)], endpoint=endpoint)
        assert got == ["ok", "ok", "ok", "miss"]
        assert all(torch.equal(out[i], page(i + 1, PAGE)) for i in range(3))
        assert r.lookup(endpoint, [key(1), key(4)]) == [True, False]
        # a scheduler asks without NIXL and without knowing the KV layout
        from vllm_kvbm.tiers.peer.control import peer_lookup

        tkeys = [layout.table_key(r._codec.names, k) for k in (key(2), key(5))]
        assert peer_lookup(endpoint, r.file_name, None, tkeys, 5.0) == [True, False]
        with pytest.raises(ValueError, match="scope mismatch"):
            peer_lookup(endpoint, r.file_name, b"x" * 32, tkeys, 5.0)
        assert r.landing.free == r.landing.count and r.landing.quarantined == 0
        # a page damaged in the peer's pool is refused, not used
        slot, _ = layout.find(
            w.pool.view, w.pool.geometry, layout.table_key(w._codec.names, key(2))
        )
        w.pool.view[w.pool.geometry.slot_off(slot) + 4096] ^= 0xFF
        assert r.get_many_into([(key(2), out[0])], endpoint=endpoint) == ["corrupt"]
        # a reader whose pages would not verify (another KV layout) is refused
        other = reader(layout_fp="other layout")
        try:
            assert other.get_many_into([(key(1), out[0])], endpoint=endpoint) == ["error"]
        finally:
            other.close()
    finally:
        r.close()
        w.close()


def test_a_slot_rewritten_while_read_is_a_miss_never_a_mixed_page(shm, procs, transport):
    """One slot, rewritten without pause by this process (the same key, two
    contents) while the peer's reader reads it: each read is a miss or one
    whole content, never a mix, never a checksum failure."""
    port = free_port()
    w = writer(shm, 1)
    proc, _ = pool_peer.start(shm, port, PAGE, 1, env=TRANSPORTS[transport])
    procs.append(proc)
    r = reader()
    contents = [page(10, PAGE), page(11, PAGE)]
    stop = threading.Event()

    def rewrite():
        # paced at random, so that some reads fall between two writes and
        # others across one, whatever a read takes on this transport
        rng = random.Random(0)
        i = 0
        while not stop.is_set():
            w.remove(key(1))
            w.put(key(1), contents[i % 2])
            i += 1
            time.sleep(rng.uniform(0, 0.02))

    endpoint = f"tcp://127.0.0.1:{port}"
    assert w.put(key(1), contents[0])
    assert read_until(r, [(key(1), outs(1)[0])], endpoint, ["ok"]) == ["ok"]
    thread = threading.Thread(target=rewrite, daemon=True)
    thread.start()
    counts = {"ok": 0, "miss": 0}
    try:
        out = outs(1)[0]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (counts["ok"] < 5 or r.torn_reads < 3):
            (status,) = r.get_many_into([(key(1), out)], endpoint=endpoint)
            assert status in ("ok", "miss"), status
            counts[status] += 1
            if status == "ok":
                assert torch.equal(out, contents[0]) or torch.equal(out, contents[1])
        assert counts["ok"] >= 1 and counts["miss"] >= 1, counts
        assert r.torn_reads >= 1, counts  # some caught by the seqlock, after the READ
    finally:
        stop.set()
        thread.join(10)
        r.close()
        w.close()


def test_a_stopped_peer_costs_a_deadline_and_quarantines_until_its_read_ends(
    shm, procs, monkeypatch
):
    monkeypatch.setenv("UCX_TLS", "tcp")  # a stopped peer stalls a TCP READ (cma copies anyway)
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS["tcp"])
    procs.append(proc)
    r = reader(read_timeout_s=1.0, retry_s=0.5)
    endpoint = f"tcp://127.0.0.1:{port}"
    items = [(key(i), o) for i, o in zip((1, 2), outs(2))]
    try:
        assert w.put(key(1), page(1, PAGE)) and w.put(key(2), page(2, PAGE))
        # connected (on a loaded machine a first read over TCP may pass its 1 s deadline:
        # read again; a late READ's landing slots come back once it ended)
        assert read_until(r, items, endpoint, ["ok", "ok"]) == ["ok", "ok"]
        settle = time.monotonic() + 15
        while r.landing.quarantined and time.monotonic() < settle:
            r.landing.reap(r._gone)
            time.sleep(0.05)
        assert r.landing.quarantined == 0
        freeze_process(proc, "the peer")  # every thread stopped before the read
        began = time.monotonic()
        assert r.get_many_into(items, endpoint=endpoint) == ["error", "error"]
        took = time.monotonic() - began
        assert 0.9 < took < 5.0, took  # the deadline, not a hang
        assert r.landing.quarantined == 2
        # meanwhile the peer is not asked again (no second deadline to wait)
        began = time.monotonic()
        assert r.get_many_into(items, endpoint=endpoint) == ["error", "error"]
        assert time.monotonic() - began < 0.8
        time.sleep(1.0)  # still stopped: the READ cannot end, its slots stay out
        r.landing.reap(r._gone)
        assert r.landing.quarantined == 2
        os.killpg(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while r.landing.quarantined and time.monotonic() < deadline:
            r.landing.reap(r._gone)
            time.sleep(0.05)
        assert r.landing.quarantined == 0 and r.landing.free == r.landing.count
        assert read_until(r, items, endpoint, ["ok", "ok"]) == ["ok", "ok"]
        assert torch.equal(items[1][1], page(2, PAGE))
    finally:
        r.close()
        w.close()


def test_a_peer_killed_mid_read_is_a_failure_not_a_hang(shm, procs, transport):
    port = free_port()
    w = writer(shm, 8)
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS[transport])
    procs.append(proc)
    r = reader(read_timeout_s=5.0, retry_s=0.5)
    endpoint = f"tcp://127.0.0.1:{port}"
    items = [(key(i), o) for i, o in zip((1, 2, 3), outs(3))]
    try:
        for i in (1, 2, 3):
            assert w.put(key(i), page(i, PAGE))
        assert r.get_many_into(items, endpoint=endpoint) == ["ok"] * 3
        freeze_process(proc, "the peer")  # its READs in flight (TCP) when it dies
        result: list = []
        thread = threading.Thread(
            target=lambda: result.append(r.get_many_into(items, endpoint=endpoint))
        )
        began = time.monotonic()
        thread.start()
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        thread.join(10)
        assert not thread.is_alive()
        took = time.monotonic() - began
        # TCP: NIXL reports the peer gone well before the 5 s deadline; cma
        # may have copied the pages before it died (the READ needs no help
        # from a stopped peer once connected)
        wants = [["error"] * 3] + ([["ok"] * 3] if transport == "default" else [])
        assert result and result[0] in wants and took < 4.5, (result, took)
        # dead: nothing stays quarantined for it, and asking again fails at once
        r.landing.reap(r._gone)
        assert r.landing.quarantined == 0
        time.sleep(0.6)
        began = time.monotonic()
        assert r.get_many_into(items, endpoint=endpoint) == ["error"] * 3
        assert time.monotonic() - began < 6.0
    finally:
        r.close()
        w.close()


def test_a_restarted_peer_is_a_new_incarnation(shm, procs, transport):
    port = free_port()
    w = writer(shm, 8)
    first, inc1 = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS[transport])
    procs.append(first)
    r = reader(read_timeout_s=1.0, retry_s=0.3, hello_every_s=0.2)
    endpoint = f"tcp://127.0.0.1:{port}"
    items = [(key(1), outs(1)[0])]
    try:
        assert w.put(key(1), page(1, PAGE))
        assert r.get_many_into(items, endpoint=endpoint) == ["ok"]
        peer = r._peers[endpoint]
        generation = peer.generation
        assert peer.incarnation == inc1
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        second, inc2 = pool_peer.start(shm, port, PAGE, 8, env=TRANSPORTS[transport])
        procs.append(second)
        assert inc2 != inc1
        # the pool file outlived the first peer: the same page, from the new one
        assert read_until(r, items, endpoint, ["ok"]) == ["ok"]
        assert torch.equal(items[0][1], page(1, PAGE))
        peer = r._peers[endpoint]
        assert peer.incarnation == inc2 and peer.generation != generation
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("old", ["reader", "holder"])
def test_tcp_segments_read_both_ways_with_a_peer_at_ucxs_defaults(shm, procs, monkeypatch, old):
    """Over TCP the holder sends a READ's bytes in segments of its
    UCX_TCP_TX_SEG_SIZE, which KVBM sets to 64 KiB where the environment
    does not (UCX's own: 8 KiB); a peer at UCX's defaults (a version of KVBM
    before it, another UCX user) receives 64 KiB segments and is read from.
    A segment larger than the reader's RX segment would crash the reader."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    at_defaults = {"UCX_TCP_TX_SEG_SIZE": "8kb"}
    port = free_port()
    w = writer(shm, 8)
    holder_env = {"UCX_TLS": "tcp", **(at_defaults if old == "holder" else {})}
    proc, _ = pool_peer.start(shm, port, PAGE, 8, env=holder_env)
    procs.append(proc)
    if old == "reader":
        monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8kb")
    r = reader(read_timeout_s=10.0)
    if old == "holder":
        assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "64kb"  # KVBM's, as the holder's is not
    try:
        for i in range(1, 9):
            assert w.put(key(i), page(i, PAGE))
        out = outs(8)
        got = r.get_many_into(
            [(key(i + 1), o) for i, o in enumerate(out)], endpoint=f"tcp://127.0.0.1:{port}"
        )
        assert got == ["ok"] * 8
        assert all(torch.equal(o, page(i + 1, PAGE)) for i, o in enumerate(out))
    finally:
        r.close()
        w.close()


def test_a_batch_holds_about_64_mib_of_pages_4_to_16():
    """Each batch waits on three READs in turn: bigger batches pay fewer of
    them per byte, bounded by the landing memory (a slot a page)."""
    from vllm_kvbm.tiers.peer.store import landing_count

    assert [landing_count(n << 20) for n in (1, 4, 8, 16, 64)] == [16, 16, 8, 4, 4]
    r = reader()
    try:
        assert r.landing.count == 16  # 1 MiB pages
    finally:
        r.close()
