"""RemoteStore against a real ``python -m lmcache.v1.server``; faults are
produced for real (the server killed and SIGSTOPped, puts cut off mid-page).
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import BIG, MiB, SMALL, key, page  # noqa: E402
from vllm_kvbm.tools.server import free_port as _free_port  # noqa: E402
from vllm_kvbm.config import KVBMConfigError  # noqa: E402
from vllm_kvbm.tiers.page_format import HEADER_BYTES, flat_u8  # noqa: E402
from vllm_kvbm.tiers.lm.store import RemoteStore  # noqa: E402


# Frozen and relayed servers are timed against the store's timeouts.
pytestmark = pytest.mark.timing


@pytest.fixture(autouse=True, scope="module")
def _boot_server_early(lm_server):
    yield


@pytest.fixture
def remote(lm_server):
    stores = []

    def make(ns="ns-a", block=SMALL, timeout_s=3.0, retry=0.3, url=None):
        if url is None:
            lm_server.wait_ready()
        s = RemoteStore(
            url or lm_server.url, block, ns, 0, 1, timeout_s=timeout_s, retry_interval_s=retry
        )
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def connected(store: RemoteStore) -> bool:
    """Whether the store's read connection is up (the one get_into uses)."""
    return store._reads.conn is not None


def raw_get(store: RemoteStore, k: bytes) -> bytes:
    """The bytes the server holds for k, read with LMCache directly."""
    conn = store._reads.conn
    mo = conn.run(conn.conn.get(store._ckey(k)), 5.0)
    assert mo is not None
    try:
        return bytes(mo.byte_array)
    finally:
        mo.ref_count_down()


def raw_put(store: RemoteStore, k: bytes, data: bytes) -> None:
    conn = store._reads.conn
    mo = conn.staging.allocate(
        torch.Size([1, 1, 1, len(data)]), torch.uint8, store._fmt, busy_loop=False
    )
    flat_u8(mo.tensor).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    fut = conn.rb.submit_put_task(store._ckey(k), mo)
    mo.ref_count_down()
    fut.result(5.0)


def test_remote_round_trip_and_remove(remote):
    s = remote(block=BIG)
    src = page(1, BIG)
    want = src.clone()
    assert s.put(key(1), src)
    src.fill_(7)
    out = torch.empty(BIG, dtype=torch.uint8)
    assert s.contains(key(1))
    assert s.get_into(key(1), out) == "ok" and torch.equal(out, want)
    assert not s.contains(key(2)) and s.get_into(key(2), out) == "miss"
    s.remove(key(1))  # lm:// has no delete: a tombstone
    assert not s.contains(key(1)) and s.get_into(key(1), out) == "miss"
    other = remote(block=BIG)  # another process sees the tombstone as a miss too
    assert other.get_into(key(1), out) == "miss"
    assert s.put(key(1), want) and s.contains(key(1))
    assert other.get_into(key(1), out) == "ok" and torch.equal(out, want)


def test_remote_namespace_isolation_and_corruption(remote):
    a, b = remote(ns="model-a"), remote(ns="model-b")
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert a.put(key(1), page(1, SMALL)) and a.put(key(2), page(2, SMALL))
    assert not b.contains(key(1)) and b.get_into(key(1), out) == "miss"
    # a's page planted under b's key for the same block: wrong namespace.
    raw_put(b, key(1), raw_get(a, key(1)))
    assert b.get_into(key(1), out) == "corrupt"
    assert b.get_into(key(1), out) == "miss"  # overwritten with a tombstone
    # Within a: key(2)'s page filed under key(3), and a flipped payload byte.
    raw_put(a, key(3), raw_get(a, key(2)))
    assert a.get_into(key(3), out) == "corrupt"
    data = bytearray(raw_get(a, key(2)))
    data[HEADER_BYTES + 100] ^= 0x10
    raw_put(a, key(2), bytes(data))
    assert a.get_into(key(2), out) == "corrupt" and not a.contains(key(2))
    assert a.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))


def test_remote_unreachable_and_bad_url(remote):
    with pytest.raises(KVBMConfigError, match="remote_url"):
        RemoteStore("redis://127.0.0.1:1", SMALL, "ns", 0, 1)
    t0 = time.monotonic()
    s = remote(url=f"lm://127.0.0.1:{_free_port()}")
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert not s.put(key(1), page(1, SMALL))
    assert not s.contains(key(1)) and s.get_into(key(1), out) == "error"
    assert time.monotonic() - t0 < 1.0 and not connected(s)


def test_remote_frozen_server_is_bounded_then_recovers(remote, lm_server):
    timeout = 1.5
    s = remote(timeout_s=timeout, retry=0.3)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.put(key(1), page(1, SMALL))
    lm_server.freeze()
    try:
        calls = [
            lambda: s.contains(key(1)),
            lambda: s.get_into(key(1), out),
            lambda: s.put(key(2), page(2, SMALL)),
        ]
        seen = []
        for i in range(6):
            t0 = time.monotonic()
            r = calls[i % 3]()
            seen.append((i % 3, r, round(time.monotonic() - t0, 3)))
            time.sleep(0.15)
        assert all(r in (False, "error") for _, r, _ in seen), seen
        assert all(dt < timeout + 0.5 for _, _, dt in seen), seen
        # It did wait on the frozen server (first call, and after reconnects).
        assert seen[0][2] > timeout / 2, seen
    finally:
        lm_server.thaw()
    # Each link (reads, writes) comes back after its own backoff, which grew
    # with each failed reconnect: at most 8 retry intervals, plus one call.
    deadline = time.monotonic() + 8 * 0.3 + timeout + 1.0
    got = stored = None
    while time.monotonic() < deadline and not (got == "ok" and stored):
        time.sleep(0.1)
        if got != "ok":
            got = s.get_into(key(1), out)
        if not stored:
            stored = s.put(key(3), page(3, SMALL))
    assert got == "ok" and torch.equal(out, page(1, SMALL)), (got, seen)
    assert stored and s.contains(key(3)), seen


def _tcp_buffer_max() -> int:
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as r, open("/proc/sys/net/ipv4/tcp_wmem") as w:
            return int(r.read().split()[2]) + int(w.read().split()[2])
    except OSError:
        return 1 << 62


def test_remote_put_cut_off_mid_page_is_overwritten(remote, lm_server):
    # A page larger than the socket buffers to a frozen server is cut off
    # mid-stream; LMCache's server then files the half-received PUT as an
    # entry whose GET kills the connection. The store overwrites such keys
    # with a tombstone when it reconnects.
    lm_server.wait_ready()
    big = 32 * MiB
    s = remote(block=big, timeout_s=3.0, retry=0.3)
    p = page(5, big)
    lm_server.freeze()
    try:
        t0 = time.monotonic()
        assert s.put(key(5), p) is False
        assert time.monotonic() - t0 < 3.5
        cut_off = len(s._suspect) == 1  # False only if the buffers took 32 MiB
        if _tcp_buffer_max() < big // 2:
            assert cut_off
    finally:
        lm_server.thaw()
    out = torch.empty(big, dtype=torch.uint8)
    # The server finishes the cut-off PUT in its own time, before or after
    # our tombstone: either way reads settle on "miss" on a healthy link.
    settled = [("miss" if cut_off else "ok", True)] * 2
    seen, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline and seen[-2:] != settled:
        time.sleep(0.35)
        seen.append((s.get_into(key(5), out), connected(s)))
    assert seen[-2:] == settled, seen
    assert all(r in ("miss", "error") for r, _ in seen) or not cut_off, seen
    assert s.put(key(5), p) and s.get_into(key(5), out) == "ok" and torch.equal(out, p)


def test_remote_half_received_entry_heals(remote, lm_server):
    # What a PUT cut off mid-page leaves on LMCache's server, made directly:
    # a PUT header, half the bytes, hang up. The server files the entry, and
    # a GET of it announces the page and then drops the connection.
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage

    s = remote(timeout_s=3.0, retry=0.3)
    assert s.put(key(1), page(1, SMALL))
    # key(6): half a page then a hang-up; key(7): complete, but longer than
    # its shape, which LMCache's client cannot receive.
    for k, length, sent in [(key(6), HEADER_BYTES + SMALL, 1000), (key(7), 2 * SMALL, 2 * SMALL)]:
        with socket.create_connection(("127.0.0.1", lm_server.port), 5) as raw:
            raw.sendall(
                ClientMetaMessage(
                    ClientCommand.PUT, s._ckey(k), length, s._fmt, torch.uint8, s._shape
                ).serialize()
            )
            raw.sendall(b"x" * sent)
    time.sleep(0.3)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.contains(key(6))
    assert s.get_into(key(6), out) == "error"  # the hang-up is seen at once...
    assert not connected(s) and key(6) in s._suspect
    time.sleep(0.4)
    assert s.get_into(key(6), out) == "miss"  # ...and the entry overwritten
    assert s.get_into(key(6), out) == "miss" and connected(s)
    assert s.get_into(key(7), out) == "error" and key(7) in s._suspect
    time.sleep(0.4)
    assert s.get_into(key(7), out) == "miss" and connected(s)
    assert s.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))


def test_remote_killed_server_then_restarted(remote, lm_server):
    s = remote(timeout_s=3.0, retry=0.3)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.put(key(1), page(1, SMALL)) and s.contains(key(1))
    lm_server.kill()
    for i in range(6):
        t0 = time.monotonic()
        assert s.get_into(key(1), out) in ("miss", "error")
        assert not s.contains(key(1))
        assert not s.put(key(2), page(2, SMALL))
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.1)
    lm_server.start()
    lm_server.wait_ready()
    time.sleep(0.4)
    assert s.put(key(3), page(3, SMALL))
    assert s.get_into(key(3), out) == "ok" and torch.equal(out, page(3, SMALL))
    assert s.get_into(key(1), out) == "miss"  # the server kept pages in memory only
    assert connected(s)


def test_exist_request_is_lmcaches_own_message(remote):
    """The scheduler's LMCache-free EXIST is byte for byte LMCache's, for the
    very key the store files the page under."""
    import torch as _torch
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage

    from vllm_kvbm.tiers.lm.protocol import exist_request
    from vllm_kvbm.tiers.page_names import page_name

    s = remote(ns="ns-exist", block=SMALL)
    ck = s._ckey(key(3))
    assert page_name("ns-exist", SMALL, 0, 1, key(3)) == ck.to_string()
    theirs = ClientMetaMessage(
        ClientCommand.EXIST, ck, 0, MemoryFormat(1), _torch.float16, _torch.Size([0, 0, 0, 0])
    ).serialize()
    assert exist_request(ck.to_string()) == theirs


def test_scheduler_remote_view_sees_what_the_store_wrote(remote, lm_server):
    from vllm_kvbm.tiers.lm.view import RemoteView

    s = remote(ns="ns-view", block=SMALL)
    assert s.put(key(4), page(4, SMALL))
    view = RemoteView(lm_server.url, "ns-view", SMALL, 1, timeout_s=2.0, retry_interval_s=0.2)
    try:
        assert view.contains(key(4))
        assert not view.contains(key(5))
        assert not RemoteView(lm_server.url, "ns-other", SMALL, 1).contains(key(4))
    finally:
        view.close()
    dead = RemoteView(
        f"lm://127.0.0.1:{_free_port()}", "ns-view", SMALL, 1, timeout_s=0.5, retry_interval_s=30
    )
    t0 = time.monotonic()
    assert not dead.contains(key(4)) and not dead.contains(key(4))
    assert time.monotonic() - t0 < 1.0  # the second call fails fast, no reconnect


def test_scheduler_remote_view_asks_many_keys_in_one_round_trip(remote, lm_server):
    from vllm_kvbm.tiers.lm.view import RemoteView

    s = remote(ns="ns-many", block=SMALL)
    for i in (1, 2, 4):
        assert s.put(key(i), page(i, SMALL))
    view = RemoteView(lm_server.url, "ns-many", SMALL, 1, timeout_s=2.0)
    try:
        assert view.contains_many([key(i) for i in range(1, 6)]) == [True, True, False, True, False]
        assert view.contains_many([]) == []
        # the stream is still in step after a batch
        assert view.contains(key(4)) and not view.contains(key(3))
    finally:
        view.close()


def test_a_frozen_remote_server_never_stalls_vllms_scheduler(lm_server):
    """Lookups behind a server run on a thread of their own: while the server
    is frozen, every scheduler step stays fast (a running request keeps
    decoding), and a new request waits for its answer (a miss, after
    remote_timeout_s) instead of the whole engine waiting."""
    import sys as _sys
    from pathlib import Path

    _sys.path.insert(0, str(Path(__file__).parents[1]))
    from helpers.scheduler_harness import BLOCK, make_request, make_scheduler, step
    from vllm.v1.request import RequestStatus

    sched = make_scheduler(host_blocks=16, remote_url=lm_server.url, remote_timeout_s=1.5)
    running = make_request([3000 + i for i in range(BLOCK + 3)], max_tokens=400)
    sched.add_request(running)
    deadline = time.monotonic() + 10
    while running.status != RequestStatus.RUNNING:
        assert time.monotonic() < deadline, "never admitted"
        step(sched, complete=True)
        time.sleep(0.005)
    lm_server.freeze()
    try:
        newcomer = make_request([4000 + i for i in range(3 * BLOCK + 1)], max_tokens=2)
        sched.add_request(newcomer)
        slowest, decoded = 0.0, running.num_output_tokens
        for _ in range(30):
            t0 = time.monotonic()
            step(sched, complete=True)
            slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 0.5, f"a step took {slowest:.2f}s with the server frozen"
        assert running.num_output_tokens >= decoded + 30  # it decoded every step
        assert newcomer.status == RequestStatus.WAITING  # its answer is still coming
        deadline = time.monotonic() + 15  # the frozen lookup times out: a miss
        while newcomer.status == RequestStatus.WAITING:
            assert time.monotonic() < deadline, "the newcomer was never admitted"
            step(sched, complete=True)
            time.sleep(0.01)
    finally:
        lm_server.thaw()


def test_a_read_does_not_wait_for_a_write_stuck_on_the_network(remote, relay):
    """Reads and writes have a connection each: a put whose path stalled
    (its relay frozen, a real TCP stall) holds only the write connection,
    and a get of the same store answers meanwhile."""
    import threading

    timeout = 3.0
    s = remote(url=relay.url, timeout_s=timeout, retry=0.3)
    assert s.put(key(1), page(1, SMALL))
    relay.freeze(s._writes.conn.sock)
    result = {}
    writer = threading.Thread(target=lambda: result.update(put=s.put(key(2), page(2, SMALL))))
    t0 = time.monotonic()
    writer.start()
    while not s._writes.lock.locked():  # the put holds the write connection
        time.sleep(0.001)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))
    assert s.contains(key(1))
    assert writer.is_alive()  # the put is still waiting for its reply
    writer.join(timeout + 2)
    assert result == {"put": False} and time.monotonic() - t0 >= timeout * 0.9
    relay.thaw()
    time.sleep(0.4)  # the write connection is re-made (through a fresh relay process)
    assert s.put(key(3), page(3, SMALL)) and s.get_into(key(3), out) == "ok"
