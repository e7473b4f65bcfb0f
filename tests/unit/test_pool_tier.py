"""The shared page pool tier on real files in /dev/shm (a memory filesystem):
layout, set-associative eviction, the seqlock, damaged and sealed pages, a
stale or mismatched file at start, the free-space check, and a second
process reading and writing the same file while the first keeps it mapped."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time

import pytest
import torch

from helpers.tier_pages import key, page
from vllm_kvbm.config import KVBMConfigError, load_config
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import Geometry, Superblock
from vllm_kvbm.tiers.pool.pool_file import (
    MEMORY_FILESYSTEMS,
    PoolSpec,
    filesystem_type,
    open_pool,
)
from vllm_kvbm.tiers.pool.store import PoolStore
from vllm_kvbm.tiers.pool.view import PoolView

pytestmark = pytest.mark.timeout(120)

PAGE = 64 * 1024 + 7  # odd: slots are 4 KiB aligned anyway
NS = "ns-pool"
SECRET = b"s" * 32


def spec(directory, pages=32, rank=0, world=1, layout_fp="L", ns=NS, page_bytes=PAGE):
    capacity = (
        layout.SUPERBLOCK_BYTES + 4096 + pages * (-(-(HEADER_BYTES + page_bytes) // 4096) * 4096)
    )
    return PoolSpec.for_worker(directory, ns, page_bytes, rank, world, layout_fp, capacity)


def store(directory, secret=None, **kw) -> PoolStore:
    s = spec(directory, **kw)
    codec = PageCodec(
        kw.get("ns", NS),
        kw.get("page_bytes", PAGE),
        secret,
        rank=kw.get("rank", 0),
        world_size=kw.get("world", 1),
        layout=kw.get("layout_fp", "L"),
    )
    return PoolStore.open(s, codec)


def slot_of(s: PoolStore, k: bytes) -> tuple[int, int]:
    return layout.find(s.pool.view, s.pool.geometry, layout.table_key(s._codec.names, k))


def read(s: PoolStore, k: bytes, n: int = PAGE) -> tuple[str, torch.Tensor]:
    out = torch.empty(n, dtype=torch.uint8)
    return s.get_into(k, out), out


# ---- layout ----------------------------------------------------------------------


def test_geometry_fills_the_capacity_in_whole_sets():
    stored = HEADER_BYTES + PAGE
    g = Geometry.for_capacity(100 * 73728, stored)
    assert 8 <= g.ways <= layout.MAX_WAYS and g.nslots % g.ways == 0 and g.nslots >= 96
    assert g.file_bytes <= 100 * 73728 and g.stride % 4096 == 0 and g.stride >= stored
    small = Geometry.for_capacity(layout.SUPERBLOCK_BYTES + 4096 + 3 * g.stride, stored)
    assert (small.nslots, small.ways, small.nsets) == (3, 3, 1)  # one set below 16 slots
    assert Geometry.for_capacity(g.stride, stored) is None


def test_superblock_round_trips_and_refuses_what_is_not_one():
    g = Geometry(4096 + 96, 32, 16)
    sb = Superblock(b"n" * 16, b"s" * 32, g, b"i" * 16, 123, 456, used_slots=7)
    assert Superblock.unpack(sb.pack()) == sb
    assert Superblock.unpack(sb.pack(), size=g.file_bytes - 1) is None  # truncated file
    bad = bytearray(sb.pack())
    bad[0] ^= 1
    assert Superblock.unpack(bytes(bad)) is None
    assert Superblock.unpack(b"\0" * 4096) is None


def test_file_is_named_from_the_scope_never_the_secret(shm):
    a = spec(shm)
    assert layout.valid_file_name(a.name) and a.name.endswith("-r0of1")
    assert spec(shm, layout_fp="other").name == a.name  # the view knows no layout
    assert spec(shm, layout_fp="other").scope_digest != a.scope_digest
    assert spec(shm, rank=1, world=2).name.endswith("-r1of2")
    assert spec(shm, ns="other").name != a.name


# ---- the store ------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip_with_and_without_a_page_secret(shm, secret):
    s = store(shm, secret)
    try:
        assert s.put(key(1), page(1, PAGE))
        status, out = read(s, key(1))
        assert status == "ok" and torch.equal(out, page(1, PAGE))
        assert read(s, key(2))[0] == "miss"
        assert s.contains(key(1)) and not s.contains(key(2))
        # under a secret the table holds a keyed hash, and the page is ciphertext
        slot, _ = slot_of(s, key(1))
        off = s.pool.geometry.slot_off(slot)
        raw = bytes(s.pool.view[off : off + HEADER_BYTES + PAGE])
        assert (key(1) in bytes(s.pool.view)) == (secret is None)
        assert (bytes(page(1, PAGE).numpy()[:4096]) in raw) == (secret is None)
        assert s.usage() == (
            s.pool.geometry.stride,
            s.pool.geometry.nslots * s.pool.geometry.stride,
        )
        s.remove(key(1))
        assert read(s, key(1))[0] == "miss" and s.usage()[0] == 0
    finally:
        s.close()


def test_a_full_set_evicts_its_least_recently_used_page(shm):
    s = store(shm, pages=4)  # one set of 4 ways
    try:
        assert s.pool.geometry.nsets == 1
        for i in range(1, 5):
            assert s.put(key(i), page(i, PAGE))
        assert read(s, key(1))[0] == "ok"  # key 1 used again: key 2 is the oldest now
        assert s.put(key(9), page(9, PAGE))
        assert s.take_removed() == [key(2)]
        assert [read(s, key(i))[0] for i in (1, 2, 3, 4, 9)] == ["ok", "miss", "ok", "ok", "ok"]
        assert not s.put(bytes(32), page(0, PAGE))  # the empty slot's mark is no key
        assert s.pool.used_slots == 4
    finally:
        s.close()


def test_a_slot_being_written_is_a_miss_and_a_dead_writers_slot_is_reused(shm):
    s = store(shm, pages=4)
    try:
        assert s.put(key(1), page(1, PAGE))
        slot, gen = layout.find(s.pool.view, s.pool.geometry, key(1))
        e = s.pool.geometry.entry_off(slot)
        layout.write_u64(s.pool.view, e, gen + 1)  # as a writer that died mid-write leaves it
        assert read(s, key(1))[0] == "miss" and not s.contains(key(1))
        for i in range(2, 5):
            assert s.put(key(i), page(i, PAGE))
        assert s.put(key(5), page(5, PAGE))  # takes the abandoned slot, not an LRU victim
        assert [read(s, key(i))[0] for i in range(2, 6)] == ["ok"] * 4
        assert layout.read_head(s.pool.view, e)[0] % 2 == 0
    finally:
        s.close()


@pytest.mark.parametrize("secret,status", [(None, "corrupt"), (SECRET, "corrupt")])
def test_a_damaged_page_is_refused_and_removed(shm, secret, status):
    s = store(shm, secret)
    try:
        assert s.put(key(1), page(1, PAGE))
        slot, _ = slot_of(s, key(1))
        off = s.pool.geometry.slot_off(slot) + HEADER_BYTES + 1000
        s.pool.view[off] ^= 0xFF
        assert read(s, key(1))[0] == status
        assert not s.contains(key(1))
    finally:
        s.close()


def test_a_page_written_without_the_secret_does_not_open_with_it(shm):
    plain = store(shm)
    plain.put(key(1), page(1, PAGE))
    plain.close()
    # the table key differs under a secret: the page is not even found
    sealed = store(shm, SECRET)
    try:
        assert read(sealed, key(1))[0] == "miss"
        # planted under the keyed name: it does not open
        tkey = layout.table_key(sealed._codec.names, key(1))
        slot, gen = layout.find(sealed.pool.view, sealed.pool.geometry, key(1))
        e = sealed.pool.geometry.entry_off(slot)
        sealed.pool.view[e + 8 : e + 40] = tkey
        assert read(sealed, key(1))[0] == "unauthenticated"
    finally:
        sealed.close()


def test_a_restarted_store_finds_its_pages_at_once(shm):
    s = store(shm)
    for i in range(1, 4):
        s.put(key(i), page(i, PAGE))
    s.close()
    again = store(shm)
    try:
        assert [read(again, key(i))[0] for i in range(1, 4)] == ["ok"] * 3
        assert again.pool.used_slots == 3
    finally:
        again.close()


def test_a_stale_file_is_replaced_and_one_in_use_is_refused(shm):
    s = store(shm, layout_fp="old")
    s.put(key(1), page(1, PAGE))
    path = s.pool.path
    with pytest.raises(KVBMConfigError, match="pool_dir: .* in use by another engine"):
        store(shm, layout_fp="new")  # the old layout's engine still maps it
    s.close()
    new = store(shm, layout_fp="new")  # unused now: replaced
    try:
        assert read(new, key(1))[0] == "miss"
        assert new.pool.superblock.scope_digest == spec(shm, layout_fp="new").scope_digest
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        new.close()
    with open(path, "r+b") as f:  # garbage where the superblock was
        f.write(b"\0" * 64)
    again = store(shm, layout_fp="new")
    try:
        assert again.put(key(2), page(2, PAGE)) and read(again, key(2))[0] == "ok"
    finally:
        again.close()


def test_a_pool_that_does_not_fit_names_the_key_and_the_fix(shm):
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    big = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "L", free + (1 << 30))
    with pytest.raises(KVBMConfigError, match=r"pool_cache_size: .*--shm-size"):
        open_pool(big)
    assert os.listdir(shm) == [big.name + ".lock"]  # nothing half made left behind


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:22 / /dev/shm rw,nosuid shared:3 - tmpfs tmpfs rw
31 22 0:30 / /srv/kv\\040pool rw - tmpfs kv rw
32 31 8:2 / /srv/kv\\040pool/disk rw shared:9 master:2 - xfs /dev/sdb rw
33 25 0:31 / /dev/shm rw - ramfs none rw
"""


def test_filesystem_type_reads_the_innermost_and_last_mount():
    assert filesystem_type("/srv/kv pool/disk/x", MOUNTINFO) == "xfs"
    assert filesystem_type("/srv/kv pool/x", MOUNTINFO) == "tmpfs"  # the space unescaped
    assert filesystem_type("/srv/kv", MOUNTINFO) == "ext4"  # a prefix is not a parent
    assert filesystem_type("/dev/shm/a", MOUNTINFO) == "ramfs"  # mounted over
    assert filesystem_type("/x", "garbage\n") is None


def test_a_pool_dir_on_a_disk_is_said_once_and_one_in_memory_is_not(shm, tmp_path, caplog):
    assert filesystem_type(shm) in MEMORY_FILESYSTEMS
    disk = str(tmp_path)
    if filesystem_type(disk) in MEMORY_FILESYSTEMS:
        pytest.skip("the test's temporary directory is in memory here")
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.tiers.pool.pool_file"):
        open_pool(spec(shm)).close()
        assert not caplog.records
        for _ in range(2):
            open_pool(spec(disk)).close()
    [record] = caplog.records
    assert f"pool_dir {disk} is on a {filesystem_type(disk)} filesystem" in record.getMessage()
    assert "tmpfs, such as /dev/shm" in record.getMessage()


def test_config_refuses_pool_keys_without_a_pool_and_a_pool_too_small():
    with pytest.raises(KVBMConfigError, match="pool_serve_port .* pool_cache_size is not"):
        load_config({"pool_serve_port": 7100}, environ={})
    config = load_config({"pool_cache_size": "64KiB"}, environ={})
    with pytest.raises(KVBMConfigError, match="pool_cache_size: 65536 bytes cannot hold"):
        config.pool_slots(1 << 20)
    assert load_config({"pool_cache_size": "64MiB"}, environ={}).pool_slots(1 << 20) == 63


# ---- the scheduler's view -----------------------------------------------------------


def test_view_sees_every_ranks_file_and_follows_a_replaced_one(shm):
    view = PoolView(shm, NS, PAGE, world_size=2)
    r0 = store(shm, rank=0, world=2)
    r1 = store(shm, rank=1, world=2)
    try:
        r0.put(key(1), page(1, PAGE))
        assert view.contains_many([key(1)]) == [False]  # rank 1 has not stored its share
        r1.put(key(1), page(2, PAGE))
        assert view.contains_many([key(1), key(2)]) == [True, False]
        r1.close()
        r1 = store(shm, rank=1, world=2, layout_fp="other")  # rank 1's file replaced
        assert view.contains_many([key(1)]) == [False]
    finally:
        r0.close()
        r1.close()
        view.close()


# ---- a second process on the same file ---------------------------------------------------


def _other_process(directory: str, done) -> None:
    """Reads the pages the parent wrote, writes one of its own, reports."""
    s = store(directory, SECRET)
    try:
        got = [read(s, key(i)) for i in range(1, 4)]
        ok = all(
            st == "ok" and torch.equal(out, page(i, PAGE)) for i, (st, out) in enumerate(got, 1)
        )
        wrote = s.put(key(7), page(7, PAGE))
        done.put((ok, wrote, os.getpid()))
    finally:
        s.close()


def test_a_second_process_reads_and_writes_the_same_file(shm):
    s = store(shm, SECRET)
    proc = None
    try:
        for i in range(1, 4):
            assert s.put(key(i), page(i, PAGE))
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        proc = ctx.Process(target=_other_process, args=(shm, done))
        proc.start()
        ok, wrote, pid = done.get(timeout=60)
        proc.join(30)
        assert ok and wrote and pid != os.getpid()
        status, out = read(s, key(7))  # the other process's page, in this mapping
        assert status == "ok" and torch.equal(out, page(7, PAGE))
        assert PoolView(shm, NS, PAGE, 1, SECRET).contains_many([key(7), key(8)]) == [True, False]
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        s.close()


def test_a_writer_stuck_holding_the_lock_costs_writes_not_reads(shm):
    """Another engine stopped in the middle of a write holds the pool's lock:
    this store's writes wait a bounded time and are refused (written again
    when reused); its reads take no lock and go on."""
    s = store(shm)
    other = store(shm)  # another engine's mapping of the same file
    try:
        s._lock_wait_s = 0.3
        assert s.put(key(1), page(1, PAGE))
        with other.pool.write_lock():
            began = time.monotonic()
            assert not s.put(key(2), page(2, PAGE))
            assert 0.25 < time.monotonic() - began < 3.0
            assert read(s, key(1))[0] == "ok"
        assert s.put(key(2), page(2, PAGE)) and read(other, key(2))[0] == "ok"
    finally:
        other.close()
        s.close()


@pytest.mark.parametrize("secret", [None, SECRET])
def test_evicted_pages_are_reported_under_their_keys(shm, secret):
    s = store(shm, secret, pages=2)  # one set of two
    try:
        for i in (1, 2, 3):
            assert s.put(key(i), page(i, PAGE))
        assert s.take_removed() == [key(1)] and s.take_removed() == []
        assert len(s._keys) <= 2 * s.pool.geometry.nslots
    finally:
        s.close()
