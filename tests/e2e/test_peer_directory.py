"""The peer directory (tiers/peer/directory.py) against a real ``redis-server``
with a password: a pool store's pages listed with their holder and a TTL as
they enter and leave its pool file, the sweep that lists them again, a
holder's liveness kept while it runs and gone when it stops or is killed,
the reader's pick (the live holder of the longest run, never this engine's
own), a queue that fills while the server is frozen (dropped and counted, no
caller waits), a directory that does not answer (a miss, at once after the
first), and the whole scheduler path against a real serving peer process: a
question without a hint finds the peer through the directory and its own
lookup confirms it (a stale entry a miss). No engine runs here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import pool_peer
from helpers.tier_pages import key, page
from test_redis_store import PASSWORD, RedisServer
from vllm_kvbm.config import load_config
from vllm_kvbm.config.secrets import Secret
from vllm_kvbm.messages import KVBMWorkerMetadata
from vllm_kvbm.metrics import KVBMStats
from vllm_kvbm.scheduler.lookups import BackgroundLookups
from vllm_kvbm.scheduler.tier_policy import LowerTiers, PeerTarget
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.page_names import PageNames
from vllm_kvbm.tiers.peer import directory as pd
from vllm_kvbm.tiers.peer.view import PeerView
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.pool_file import open_pool
from vllm_kvbm.tiers.pool.store import PoolStore
from vllm_kvbm.tools.server import free_port
from vllm_kvbm.worker.tier_io import TierIO

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="redis-server not installed (scripts/setup_tools.sh installs it)",
    ),
]

PAGE = 1 << 14
NS, SECRET = "ns-peer", b"k" * 32
EP, OTHER = "tcp://127.0.0.1:7301", "tcp://127.0.0.1:7401"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def srv(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()


@pytest.fixture
def closing():
    """Things a test opened (links, writers, stores, processes): closed after it."""
    things: list = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, subprocess.Popen):
            if thing.poll() is None:
                os.killpg(thing.pid, signal.SIGCONT)
                os.killpg(thing.pid, signal.SIGKILL)
                thing.wait(30)
        else:
            thing.close()


def link(srv, closing, timeout_s: float = 1.0):
    made = pd.open_link(srv.url, Secret(PASSWORD, "remote_password_file f"), timeout_s, "test")
    closing.append(made)
    return made


def tkey(i: int) -> bytes:
    return layout.table_key(PageNames(NS, PAGE, SECRET), key(i))


def codec() -> PageCodec:
    return PageCodec(NS, PAGE, SECRET, layout="L")


def listed(srv, file_name: str) -> dict[bytes, tuple[str, int]]:
    """table key -> (endpoint, TTL in ms) of every entry of ``file_name``."""
    with srv.admin() as c:
        names = list(c.scan_iter(match=f"{pd.KEY_PREFIX}:{file_name}:*"))
        return {
            bytes.fromhex(n.decode().rsplit(":", 1)[1]): (c.get(n).decode(), c.pttl(n))
            for n in names
        }


def wait_for(what, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


def store_with_directory(
    srv,
    shm,
    closing,
    pages: int = 8,
    ttl_s: float = 30.0,
    sweep: bool = False,
    timeout_s: float = 1.0,
    **writer_kw,
) -> PoolStore:
    store = PoolStore.open(pool_peer.pool_spec(shm, PAGE, pages, NS), codec())
    writer = pd.DirectoryWriter(
        link(srv, closing, timeout_s),
        store.pool.name,
        EP,
        ttl_s,
        pool=store.pool if sweep else None,
        **writer_kw,
    )
    store.directory = pd.PoolDirectory(writer, None, link(srv, closing))
    closing.append(store)
    return store


def held(store: PoolStore, n: int) -> set[bytes]:
    return {tkey(i) for i in range(1, n + 1) if store.contains(key(i))}


def test_pages_entering_and_leaving_a_pool_are_listed_with_their_holder_and_a_ttl(
    srv, shm, closing
):
    store = store_with_directory(srv, shm, closing)  # one set of 8 slots
    writer = store.directory.writer
    for i in range(1, 9):
        assert store.put(key(i), page(i, PAGE))
    assert writer.flush()
    entries = listed(srv, store.pool.name)
    assert set(entries) == {tkey(i) for i in range(1, 9)}
    assert all(ep == EP and 25_000 < ttl <= 30_000 for ep, ttl in entries.values())
    # under a page secret the directory names keyed hashes, never the page keys
    assert not any(key(i).hex() in str(entries) for i in range(1, 9))
    time.sleep(1.2)
    assert store.put(key(5), page(5, PAGE))  # written again: its TTL renewed
    assert writer.flush()
    entries = listed(srv, store.pool.name)
    assert entries[tkey(5)][1] > entries[tkey(6)][1] + 800
    assert store.put(key(9), page(9, PAGE))  # the set is full: one page evicted
    assert writer.flush()
    assert set(listed(srv, store.pool.name)) == held(store, 9) and len(held(store, 9)) == 8
    store.remove(key(9))
    assert writer.flush()
    assert tkey(9) not in listed(srv, store.pool.name)
    # another holder's entry for a page (last writer wins) is not this pool's to delete
    with srv.admin() as c:
        c.set(pd.entry_key(store.pool.name, tkey(6)), OTHER)
    store.remove(key(6))
    assert writer.flush()
    assert listed(srv, store.pool.name)[tkey(6)][0] == OTHER
    # (deletes sent: the eviction, and the two removes, the last one a no-op there)
    assert writer.written == 10 and writer.deleted == 3 and writer.dropped == 0


def test_a_sweep_lists_the_pages_a_file_holds_again(srv, shm, closing):
    plain = PoolStore.open(pool_peer.pool_spec(shm, PAGE, 8, NS), codec())
    closing.append(plain)
    for i in range(1, 5):
        assert plain.put(key(i), page(i, PAGE))
    # a writer on a file found with pages in it lists them at once, unasked
    writer = pd.DirectoryWriter(
        link(srv, closing), plain.pool.name, EP, 30.0, pool=plain.pool, sweep_every_s=3600
    )
    closing.append(writer)
    assert wait_for(lambda: len(listed(srv, plain.pool.name)) == 4)
    assert set(listed(srv, plain.pool.name)) == {tkey(i) for i in range(1, 5)}
    with srv.admin() as c:  # entries lost (the server's eviction, a flush)
        c.flushdb()
    writer.sweep_now()
    assert wait_for(lambda: len(listed(srv, plain.pool.name)) == 4)
    assert wait_for(lambda: writer.sweeps == 2)


LIVENESS_CHILD = """
import sys, time
from vllm_kvbm.config.secrets import Secret
from vllm_kvbm.tiers.peer import directory as pd
link = pd.open_link(sys.argv[1], Secret(sys.argv[2], "f"), 1.0, "child")
pd.Liveness(link, sys.argv[3], "child", every_s=0.2, ttl_s=3.0)
print("alive", flush=True)
time.sleep(600)
"""


def test_liveness_is_kept_while_its_process_runs_and_gone_when_it_stops_or_dies(srv, closing):
    alive = pd.Liveness(link(srv, closing), EP, "inc-1", every_s=0.2, ttl_s=1.0)
    with srv.admin() as c:
        assert wait_for(lambda: c.get(pd.alive_key(EP)) == b"inc-1")
        assert 0 < c.pttl(pd.alive_key(EP)) <= 1000
        time.sleep(1.5)  # past its TTL: refreshed meanwhile
        assert c.exists(pd.alive_key(EP)) and alive.beats >= 5
        alive.close()  # a clean stop: gone at once
        assert not c.exists(pd.alive_key(EP))
        child = subprocess.Popen(
            [sys.executable, "-c", LIVENESS_CHILD, srv.url, PASSWORD, OTHER],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        closing.append(child)
        assert child.stdout.readline().strip() == "alive"
        assert wait_for(lambda: c.exists(pd.alive_key(OTHER)))
        os.killpg(child.pid, signal.SIGKILL)  # a crash: nothing deletes it
        killed = time.monotonic()
        child.wait(10)
        # its 3 s TTL (long enough that a loaded machine still sees the key
        # after the kill) is what removes it
        assert c.exists(pd.alive_key(OTHER))
        assert wait_for(lambda: not c.exists(pd.alive_key(OTHER)), timeout=8.0)
        assert time.monotonic() - killed < 4.5


def set_entries(srv, file_name: str, holders: list[str | None]) -> list[bytes]:
    """Entries for pages 1..n naming ``holders`` (None: no entry); their table keys."""
    tkeys = [tkey(i) for i in range(1, len(holders) + 1)]
    with srv.admin() as c:
        for t, holder in zip(tkeys, holders):
            if holder is not None:
                c.set(pd.entry_key(file_name, t), holder)
    return tkeys


def set_alive(srv, *endpoints: str) -> None:
    with srv.admin() as c:
        for endpoint in endpoints:
            c.set(pd.alive_key(endpoint), "x", px=60_000)


def test_the_reader_picks_the_live_holder_of_the_longest_run_and_never_its_own(srv, closing):
    reader = pd.DirectoryReader(link(srv, closing), "f0")
    tkeys = set_entries(srv, "f0", [EP, EP, EP, OTHER, OTHER, None])
    assert reader.locate(tkeys) is None  # entries of holders not alive count for nothing
    set_alive(srv, EP, OTHER)
    assert reader.locate(tkeys) == EP
    assert reader.locate(tkeys[3:]) == OTHER
    assert reader.locate(tkeys[5:]) is None  # the first page asked has no holder
    # its own endpoint never: its entries neither count nor end another's run
    assert reader.locate(tkeys, exclude=frozenset({EP})) == OTHER
    with srv.admin() as c:
        c.delete(pd.alive_key(EP))  # EP died: its entries are ignored
        assert reader.locate(tkeys) == OTHER
        c.set(pd.entry_key("f0", tkeys[0]), b"\xff not an endpoint")
        assert reader.locate(tkeys[:1]) is None
    assert reader.asked == 7 and reader.found == 4 and reader.missed == 3
    # the scheduler side counts them by result (kvbm_peer_directory_lookups_total)
    stats = KVBMStats()
    lower = LowerTiers([], peer_view=PeerView(NS, PAGE, 1, directory=reader))
    lower.report_links(stats)
    assert reader.locate(tkeys[5:]) is None
    lower.report_links(stats)
    assert stats.take()["counters"] == {
        "peer_directory_lookups@found": 4,
        "peer_directory_lookups@missed": 4,
    }


def test_a_full_queue_drops_and_counts_entries_and_no_caller_waits(srv, shm, closing):
    store = store_with_directory(
        srv, shm, closing, sweep=True, timeout_s=2.0, queue_entries=8, sweep_every_s=3600
    )
    writer = store.directory.writer
    assert wait_for(lambda: writer.sweeps == 1) and writer.flush()
    srv.freeze()
    try:
        writer.stored(tkey(100))  # the thread takes it and waits on the frozen server
        time.sleep(0.3)
        t0 = time.monotonic()
        for i in range(101, 201):
            writer.stored(tkey(i))
        assert time.monotonic() - t0 < 0.1
        assert writer.dropped == 92  # 8 queued
        for i in range(1, 9):  # the pool's own puts: their entries dropped, they go on
            assert store.put(key(i), page(i, PAGE))
        assert writer.dropped == 100 and time.monotonic() - t0 < 1.0
    finally:
        srv.thaw()
    assert writer.flush()
    pages = held(store, 8)
    assert len(pages) == 8 and not pages & set(listed(srv, store.pool.name))
    # what the worker reports of them each poll (kvbm_peer_directory_entries_total)
    counts = store.counts()
    assert counts["dropped"] == 100 and counts["written"] >= 1 and counts["failed"] == 0
    io, meta = TierIO(), KVBMWorkerMetadata()
    io.add(store)
    closing.append(io)
    io.poll(meta)
    assert meta.tier_counts == {("pool", 0): counts}
    writer.sweep_now()  # the next sweep lists what was dropped
    assert wait_for(lambda: pages <= set(listed(srv, store.pool.name)), timeout=15)


def test_a_directory_that_does_not_answer_is_a_miss_without_waiting(srv, closing):
    reader = pd.DirectoryReader(link(srv, closing, timeout_s=0.5), "f0")
    tkeys = set_entries(srv, "f0", [EP, EP])
    set_alive(srv, EP)
    assert reader.locate(tkeys) == EP
    srv.freeze()
    try:
        t0 = time.monotonic()
        assert reader.locate(tkeys) is None
        assert time.monotonic() - t0 < 1.5  # one timeout, at most
        assert reader.down
        t0 = time.monotonic()
        assert reader.locate(tkeys) is None  # down: a miss at once while it reconnects
        assert time.monotonic() - t0 < 0.05
    finally:
        srv.thaw()
    assert wait_for(lambda: reader.locate(tkeys) == EP, timeout=30, every=0.2)
    srv.kill()
    t0 = time.monotonic()
    assert reader.locate(tkeys) is None and time.monotonic() - t0 < 1.5


def test_kvbm_pool_keeps_its_liveness_and_lists_its_rank0_files(srv, shm, closing):
    from vllm_kvbm.tools.pool import PoolService

    plain = PoolStore.open(pool_peer.pool_spec(shm, PAGE, 8, NS), codec())
    for i in range(1, 4):
        assert plain.put(key(i), page(i, PAGE))
    name = plain.pool.name
    plain.close()
    port = free_port()
    service = PoolService(
        shm,
        os.path.join(shm, "sock", "pool.sock"),
        "127.0.0.1",
        port,
        peer_directory={"url": srv.url, "password": Secret(PASSWORD, "f"), "ttl_s": 30.0},
    )
    closing.append(service)
    endpoint = f"tcp://127.0.0.1:{port}"
    assert service.endpoint == endpoint
    assert service.adopt_existing() == 1
    with srv.admin() as c:
        assert wait_for(lambda: c.exists(pd.alive_key(endpoint)))
    assert wait_for(lambda: set(listed(srv, name)) == {tkey(i) for i in range(1, 4)})
    assert {ep for ep, _ in listed(srv, name).values()} == {endpoint}
    service.close()
    with srv.admin() as c:
        assert not c.exists(pd.alive_key(endpoint))


def test_only_rank0_of_a_served_pool_writes_the_directory(srv, shm, closing):
    config = load_config(
        {
            "peer_directory_url": srv.url,
            "pool_cache_size": "1MiB",
            "pool_serve_port": 7300,
            "peer_directory_ttl_s": 60,
        },
        environ={"KVBM_REMOTE_PASSWORD": PASSWORD},
    )
    pool = open_pool(pool_peer.pool_spec(shm, PAGE, 8, NS))
    closing.append(pool)
    assert pd.pool_directory(config, pool, None, 0) is None  # not served: nothing to list
    pool.served_at = EP
    assert pd.pool_directory(config, pool, None, 1) is None  # rank 1: a reader asks rank 0
    made = pd.pool_directory(config, pool, None, 0)
    closing.insert(1, made)
    assert made.writer.endpoint == EP and made.liveness is None  # kvbm-pool's to keep
    bad = load_config(
        {"peer_directory_url": srv.url, "peer_reads": True},
        environ={"KVBM_REMOTE_PASSWORD": "wrong-one"},
    )
    with pytest.raises(Exception, match="remote_password|KVBM_REMOTE_PASSWORD") as info:
        pd.config_link(bad, "test")
    assert "wrong-one" not in str(info.value)


def test_a_question_without_a_hint_finds_the_peer_through_the_directory(srv, shm, closing):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc, _ = pool_peer.start(shm, port, PAGE, 8)
    closing.append(proc)
    store = PoolStore.open(pool_peer.pool_spec(shm, PAGE, 8, NS), codec())
    closing.append(store)
    writer = pd.DirectoryWriter(link(srv, closing), store.pool.name, endpoint, 30.0)
    closing.append(writer)
    store.directory = writer  # the peer's pages, listed as its worker lists them
    for i in range(1, 5):
        assert store.put(key(i), page(i, PAGE))
    assert writer.flush()
    liveness = pd.Liveness(link(srv, closing), endpoint, "peer", every_s=0.2, ttl_s=1.0)
    closing.append(liveness)
    view = PeerView(
        NS,
        PAGE,
        1,
        SECRET,
        timeout_s=1.0,
        directory=pd.DirectoryReader(link(srv, closing), store.pool.name),
    )
    closing.append(view)
    lower = LowerTiers([], peer_view=view)
    keys = [key(i) for i in range(1, 7)]
    target = PeerTarget()
    assert wait_for(lambda: lower.find_run_doubling(keys, target) == ["peer"] * 4)
    assert target.endpoint == endpoint and not target.hinted
    # through the lookup thread: the answer names the peer its load reads from
    lookups = BackgroundLookups(lower)
    answer = wait_for(lambda: lookups.ask_at("r1", keys, 0, len(keys)))
    assert answer == (["peer"] * 4, 0, endpoint)
    # a stale entry (the page is not in the peer's pool): the peer's lookup says no
    with srv.admin() as c:
        c.set(pd.entry_key(store.pool.name, tkey(5)), endpoint)
    assert lower.find_each([key(5)]) == [None]
    # this engine's own endpoint is never asked
    view.set_own(endpoint)
    assert lower.find_run_doubling(keys) == []
    view.set_own(None)
    # the holder's liveness gone: its entries stop counting at once
    liveness.close()
    t0 = time.monotonic()
    assert lower.find_run_doubling(keys) == [] and time.monotonic() - t0 < 0.5
