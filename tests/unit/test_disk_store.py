"""DiskStore against LMCache's real disk backend and real files; faults are
produced for real (bytes flipped and files cut on disk, a full tmpfs).
"""

from __future__ import annotations

import glob
import os
import shutil
import time

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.system import mount_tmpfs, umount  # noqa: E402
from helpers.tier_pages import BIG, MiB, SMALL, key, page, phys  # noqa: E402
from vllm_kvbm.config import KVBMConfigError  # noqa: E402
from vllm_kvbm.tiers import page_checksum  # noqa: E402
from vllm_kvbm.tiers.disk.store import DiskStore  # noqa: E402
from vllm_kvbm.tiers.page_format import HEADER_BYTES  # noqa: E402
from vllm_kvbm.tiers.page_names import disk_page_path  # noqa: E402


def files(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if not f.startswith(".kvbm-"))  # probe and lock files


def used_bytes(store: DiskStore) -> int:
    return int(store._disk.current_cache_size)


def stored_keys(store: DiskStore) -> list[bytes]:
    with store._disk.disk_lock:
        return [int(k.chunk_hash).to_bytes(32, "big") for k in store._disk.dict]


def path_of(store: DiskStore, k: bytes) -> str:
    return store._disk._key_to_path(store._ckey(k))


@pytest.fixture
def disk(tmp_path):
    stores = []

    def make(capacity=64 * MiB, block=SMALL, ns="ns-a", directory=None, **kw):
        s = DiskStore(str(directory or tmp_path / "cache"), capacity, block, ns, 0, 1, **kw)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


# ---------------------------------------------------------------- disk ----


def test_disk_round_trip_copies_and_removes(disk):
    s = disk(block=BIG)
    src = [page(i, BIG) for i in range(3)]
    want = [p.clone() for p in src]
    for i, p in enumerate(src):
        assert s.put(key(i), p)
        p.fill_(0)  # the caller may reuse its memory once put returns
    out = torch.empty(BIG, dtype=torch.uint8)
    for i in range(3):
        assert s.contains(key(i))
        assert s.get_into(key(i), out) == "ok"
        assert torch.equal(out, want[i])
    assert len(files(s.directory)) == 3
    assert os.path.getsize(path_of(s, key(0))) == HEADER_BYTES + BIG
    # The scheduler finds the files by name without LMCache.
    assert disk_page_path(s.directory, "ns-a", BIG, 0, 1, key(0)) == path_of(s, key(0))
    assert not os.path.exists(disk_page_path(s.directory, "ns-b", BIG, 0, 1, key(0)))
    assert not s.contains(key(9)) and s.get_into(key(9), out) == "miss"
    s.remove(key(1))
    assert not s.contains(key(1)) and s.get_into(key(1), out) == "miss"
    assert not os.path.exists(path_of(s, key(1)))
    assert used_bytes(s) == 2 * phys(BIG)
    # Bad arguments are refused, never raised.
    assert not s.put(key(5), torch.zeros(BIG - 1, dtype=torch.uint8))
    assert not s.put(b"short", want[0])
    assert s.get_into(key(0), torch.empty(BIG, dtype=torch.int32)) == "error"


def test_disk_restart_adopts_pages_newest_first(disk, tmp_path):
    d = tmp_path / "cache"
    a = disk(directory=d)
    for i in range(4):
        assert a.put(key(i), page(i, SMALL))
    a.close()
    now = time.time()
    for i in range(4):  # key(i) written i-th: make the order unambiguous
        os.utime(path_of(a, key(i)), (now - 100 + i, now - 100 + i))
    stray = d / (os.path.basename(path_of(a, key(7))) + ".tmp")
    stray.write_bytes(b"half a page")
    foreign = d / "someone-else.pt"
    foreign.write_bytes(b"not ours")

    b = disk(directory=d)
    assert b.adopted == 4
    assert set(stored_keys(b)) == {key(i) for i in range(4)}
    out = torch.empty(SMALL, dtype=torch.uint8)
    for i in range(4):
        assert b.get_into(key(i), out) == "ok" and torch.equal(out, page(i, SMALL))
    assert not stray.exists() and foreign.exists()
    b.close()

    # A smaller capacity keeps the newest pages and deletes the rest.
    for i in range(4):
        os.utime(path_of(a, key(i)), (now - 100 + i, now - 100 + i))
    c = disk(directory=d, capacity=2 * phys(SMALL))
    assert sorted(stored_keys(c)) == sorted([key(2), key(3)])
    assert not os.path.exists(path_of(c, key(0))) and not os.path.exists(path_of(c, key(1)))
    assert used_bytes(c) == 2 * phys(SMALL)
    assert c.put(key(8), page(8, SMALL))  # evicts key(2), the older survivor
    assert not c.contains(key(2)) and c.contains(key(3))


def test_disk_read_touches_only_stale_pages(disk, tmp_path):
    """A hit moves the page's mtime (the LRU order a restart adopts) when it is
    older than a minute; a page read again within the minute is not touched
    again (the inode updates cost warm reads in flight 15% here)."""
    s = disk(directory=tmp_path / "cache")
    out = torch.empty(SMALL, dtype=torch.uint8)
    for i in range(2):
        assert s.put(key(i), page(i, SMALL))
    old = time.time() - 3600
    os.utime(path_of(s, key(0)), (old, old))
    recent = time.time() - 5
    os.utime(path_of(s, key(1)), (recent, recent))
    assert s.get_into(key(0), out) == "ok" and s.get_into(key(1), out) == "ok"
    assert os.stat(path_of(s, key(0))).st_mtime > time.time() - 60
    assert os.stat(path_of(s, key(1))).st_mtime == pytest.approx(recent, abs=1e-3)


def test_disk_namespace_isolation(disk, tmp_path):
    d = tmp_path / "cache"
    a = disk(directory=d, ns="model-a|bf16")
    b = disk(directory=d, ns="model-b|bf16")
    assert a.put(key(1), page(1, SMALL))
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert not b.contains(key(1)) and b.get_into(key(1), out) == "miss"
    # Same namespace string, other block size: also a different namespace.
    c = disk(directory=d, ns="model-a|bf16", block=SMALL + 1)
    assert c.adopted == 0 and not c.contains(key(1))
    # A restarted b does not adopt a's files...
    b.close()
    b2 = disk(directory=d, ns="model-b|bf16")
    assert b2.adopted == 0
    b2.close()
    # ...and a's bytes filed under b's name are caught by the header.
    shutil.copy(path_of(a, key(1)), path_of(b2, key(1)))
    b3 = disk(directory=d, ns="model-b|bf16")
    assert b3.contains(key(1))
    assert b3.get_into(key(1), out) == "corrupt"
    assert not os.path.exists(path_of(b3, key(1)))
    assert a.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))


def test_disk_lru_eviction_by_bytes(disk):
    s = disk(capacity=3 * phys(SMALL))
    out = torch.empty(SMALL, dtype=torch.uint8)
    for i in range(3):
        assert s.put(key(i), page(i, SMALL))
    assert s.get_into(key(0), out) == "ok"  # key(0) is now the most recent
    assert s.put(key(3), page(3, SMALL))  # evicts key(1), the least recent
    assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert not os.path.exists(path_of(s, key(1)))
    assert len(files(s.directory)) == 3 and used_bytes(s) == 3 * phys(SMALL)
    # One byte less than three pages holds two.
    t = disk(capacity=3 * phys(SMALL) - 1, directory=s.directory + "-2")
    for i in range(3):
        assert t.put(key(i), page(i, SMALL))
    assert [t.contains(key(i)) for i in range(3)] == [False, True, True]


def test_disk_flipped_bytes_and_swapped_files_are_corrupt(disk):
    s = disk()
    for i in range(4):
        assert s.put(key(i), page(i, SMALL))
    out = torch.empty(SMALL, dtype=torch.uint8)

    def flip(k, offset):
        p = path_of(s, k)
        with open(p, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x01]))

    flip(key(0), HEADER_BYTES + SMALL // 2)  # payload
    flip(key(1), 20)  # key field of the header
    flip(key(2), HEADER_BYTES - 2)  # the checksum itself
    for i in range(3):
        out.fill_(0)
        assert s.get_into(key(i), out) == "corrupt"
        assert not os.path.exists(path_of(s, key(i)))
        assert not s.contains(key(i)) and s.get_into(key(i), out) == "miss"
    # A valid page of key(3) stored under key(5)'s name.
    assert s.put(key(5), page(5, SMALL))
    shutil.copy(path_of(s, key(3)), path_of(s, key(5)))
    assert s.get_into(key(5), out) == "corrupt"
    assert s.get_into(key(3), out) == "ok" and torch.equal(out, page(3, SMALL))
    assert used_bytes(s) == 1 * phys(SMALL)


def test_disk_deleted_and_truncated_files(disk):
    s = disk()
    for i in range(4):
        assert s.put(key(i), page(i, SMALL))
    out = torch.empty(SMALL, dtype=torch.uint8)
    os.remove(path_of(s, key(0)))
    assert s.get_into(key(0), out) == "miss" and not s.contains(key(0))
    for i, size in [(1, HEADER_BYTES + SMALL // 2), (2, 10)]:
        os.truncate(path_of(s, key(i)), size)
        assert s.get_into(key(i), out) == "corrupt"  # never the stale staging bytes
        assert not os.path.exists(path_of(s, key(i)))
    with open(path_of(s, key(3)), "ab") as f:  # grown by one byte
        f.write(b"x")
    assert s.get_into(key(3), out) == "corrupt"
    assert used_bytes(s) == 0 and stored_keys(s) == []
    # The whole directory removed under a running store: refusals, no raise.
    shutil.rmtree(s.directory)
    assert s.put(key(9), page(9, SMALL)) is False
    assert s.get_into(key(9), out) == "miss"


def test_pages_of_either_checksum_are_verified_with_or_without_isal(disk, monkeypatch):
    """Pages are written with CRC-32 through ISA-L (isal is a dependency);
    CRC-32C pages (written without isal) still verify, and CRC-32 pages
    verify on an engine without isal (zlib's crc32 is the same function)."""
    import zlib

    assert page_checksum.FAST_CRC32 and page_checksum.WRITE_ALG == page_checksum.ALG_CRC32
    s = disk()
    out = torch.empty(SMALL, dtype=torch.uint8)
    for i, (alg, reader) in enumerate(
        [
            (page_checksum.ALG_CRC32C, page_checksum.crc32),
            (page_checksum.ALG_CRC32, page_checksum.crc32),
            (page_checksum.ALG_CRC32, zlib.crc32),
        ]
    ):
        monkeypatch.setattr(page_checksum, "WRITE_ALG", alg)
        assert s.put(key(i), page(i, SMALL))
        monkeypatch.setattr(page_checksum, "WRITE_ALG", page_checksum.ALG_CRC32)
        monkeypatch.setattr(page_checksum, "crc32", reader)
        with open(path_of(s, key(i)), "rb") as f:
            assert int.from_bytes(f.read(8)[6:8], "little") == alg
        assert s.get_into(key(i), out) == "ok" and torch.equal(out, page(i, SMALL))
        with open(path_of(s, key(i)), "r+b") as f:
            f.seek(HEADER_BYTES + 5)
            f.write(b"\xff\x00")
        assert s.get_into(key(i), out) == "corrupt"


def test_disk_full_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=4m")
    try:
        block = MiB
        s = DiskStore(str(mnt), 64 * MiB, block, "ns", 0, 1)
        try:
            results = [s.put(key(i), page(i, block)) for i in range(6)]
            assert results[:3] == [True] * 3 and results[3:] == [False] * 3
            assert glob.glob(str(mnt / "*.tmp")) == []
            assert len(files(mnt)) == 3 and used_bytes(s) == 3 * phys(block)
            out = torch.empty(block, dtype=torch.uint8)
            assert s.get_into(key(2), out) == "ok" and torch.equal(out, page(2, block))
            assert s.get_into(key(4), out) == "miss"
            s.remove(key(0))
            assert s.put(key(4), page(4, block))  # space and accounting came back
            assert s.get_into(key(4), out) == "ok" and torch.equal(out, page(4, block))
        finally:
            s.close()
    finally:
        umount(mnt)


def test_disk_unusable_directory_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(KVBMConfigError, match="disk_cache_dir.*cannot create.*writable"):
        DiskStore(str(blocker / "cache"), 64 * MiB, SMALL, "ns", 0, 1)
    ro = tmp_path / "ro"
    mount_tmpfs(ro, "size=1m,ro")  # root ignores modes; a read-only mount it can't
    try:
        with pytest.raises(KVBMConfigError, match="disk_cache_dir.*not writable.*writable"):
            DiskStore(str(ro), 64 * MiB, SMALL, "ns", 0, 1)
    finally:
        umount(ro)
    with pytest.raises(KVBMConfigError, match="disk_cache_size"):
        DiskStore(str(tmp_path / "ok"), 4096, SMALL, "ns", 0, 1)


@pytest.mark.parametrize("block", [BIG, SMALL])
def test_one_page_size_formula_for_config_and_store(disk, block):
    """What LMCache charges per page is what config.disk_blocks assumes."""
    from vllm_kvbm.config import load_config

    s = disk(block=block)
    assert s._phys == phys(block)
    cfg = load_config({"disk_cache_dir": s.directory, "disk_cache_size": f"{10 * phys(block)}B"})
    assert cfg.disk_blocks(block) == 10


def test_staging_freed_by_the_garbage_collector_under_lmcaches_lock_does_not_deadlock(disk):
    """LMCache frees a MemoryObj in __del__ under the same global lock its
    metric code holds; a collection inside that code (as when a remote store
    reconnects after dropping a connection) must not hang the thread."""
    import gc
    import threading

    import lmcache.utils

    s = disk()
    leaked = s._staging.allocate(s._shape, torch.uint8, s._fmt, busy_loop=False)
    assert leaked is not None
    cycle = [leaked]
    cycle.append(cycle)  # only the cyclic collector can free it now
    del leaked, cycle
    worker = threading.Thread(target=lmcache.utils.thread_safe(gc.collect), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "garbage collection under LMCache's lock deadlocked"


def test_page_files_are_owner_only_and_never_written_through_a_symlink(disk, tmp_path):
    s = disk()
    assert s.put(key(1), page(1, SMALL))
    assert os.stat(path_of(s, key(1))).st_mode & 0o777 == 0o600
    # Someone plants a link where the next page's temporary file will go.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, path_of(s, key(2)) + ".tmp")
    assert s.put(key(2), page(2, SMALL))
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(path_of(s, key(2)))
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.get_into(key(2), out) == "ok" and torch.equal(out, page(2, SMALL))


def test_a_page_replaced_by_a_symlink_is_never_read_through_it(disk, tmp_path):
    s = disk()
    assert s.put(key(3), page(3, SMALL))
    # A valid page of the same key elsewhere (e.g. copied from another engine's
    # directory) is linked in: the store must not follow it.
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.copy(path_of(s, key(3)), elsewhere)
    os.remove(path_of(s, key(3)))
    os.symlink(elsewhere, path_of(s, key(3)))
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.get_into(key(3), out) == "corrupt"
    assert not os.path.lexists(path_of(s, key(3))) and elsewhere.exists()


def test_a_second_store_of_the_same_model_and_rank_on_a_directory_is_refused(disk, tmp_path):
    d = tmp_path / "shared"
    a = disk(directory=d, ns="model-a", capacity=2 * phys(SMALL))
    with pytest.raises(
        KVBMConfigError,
        match=r"disk_cache_dir: .* in use by another engine "
        rf"\(pid {os.getpid()}\).*own disk_cache_dir",
    ):
        disk(directory=d, ns="model-a")
    # Another rank, or another model, may share the directory: each evicts
    # and counts only its own pages.
    other_rank = DiskStore(str(d), 2 * phys(SMALL), SMALL, "model-a", 1, 2)
    b = disk(directory=d, ns="model-b", capacity=2 * phys(SMALL))
    try:
        for i in range(4):  # a's capacity is two pages: it evicts its own only
            assert a.put(key(i), page(i, SMALL))
        assert b.put(key(10), page(10, SMALL)) and other_rank.put(key(11), page(11, SMALL))
        assert used_bytes(a) == 2 * phys(SMALL) and used_bytes(b) == phys(SMALL)
        assert b.contains(key(10)) and other_rank.contains(key(11))
        assert os.path.exists(path_of(b, key(10)))
    finally:
        other_rank.close()
    a.close()
    again = disk(directory=d, ns="model-a")  # free again once the first store closed
    assert again.adopted == 2


def test_lmcache_leaves_the_prometheus_multiprocess_dir_unset(tmp_path):
    """LMCache would point PROMETHEUS_MULTIPROC_DIR at a fixed, never-wiped
    /tmp directory in this process's environment, and every vllm serve started
    afterwards would add earlier servers' counters to its own."""
    import subprocess
    import sys

    code = f"""
import os, sys
sys.path.insert(0, {str(os.path.dirname(os.path.dirname(__file__)))!r})
import torch
from helpers.tier_pages import SMALL, key, page
from vllm_kvbm.tiers.disk.store import DiskStore
s = DiskStore({str(tmp_path / "cache")!r}, 1 << 24, SMALL, "ns", 0, 1)
assert s.put(key(1), page(1, SMALL))
out = torch.empty(SMALL, dtype=torch.uint8)
assert s.get_into(key(1), out) == "ok"
s.close()
print("DIR=" + repr(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))
"""
    env = {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DIR=None" in out.stdout


def test_pages_the_lru_or_a_check_deleted_are_reported_once(disk):
    """The scheduler forgets them, so a hot page is written down again."""
    s = disk(capacity=2 * phys(SMALL))
    for i in range(3):  # the third evicts the first
        assert s.put(key(i), page(i, SMALL))
    assert s.take_removed() == [key(0)]
    assert s.take_removed() == []
    with open(path_of(s, key(1)), "r+b") as f:  # damage
        f.seek(HEADER_BYTES + 5)
        f.write(b"\xff")
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.get_into(key(1), out) == "corrupt"
    assert s.take_removed() == [key(1)]


def test_evictions_reach_the_scheduler_through_the_worker_metadata(disk):
    import time as _time

    from vllm_kvbm.messages import KVBMWorkerMetadata
    from vllm_kvbm.worker.tier_io import TierIO

    io = TierIO()
    store = disk(capacity=2 * phys(SMALL))
    io.add(store)
    meta = KVBMWorkerMetadata()
    for i in range(3):
        io.spill(["disk"], [(key(i), page(i, SMALL))])
    ended = lambda: sum(meta.tier_events[("disk", what, 0)] for what in ("stored", "refused"))  # noqa: E731
    deadline = _time.monotonic() + 30
    while ended() < 3:
        assert _time.monotonic() < deadline, "spills never finished"
        io.poll(meta)
        _time.sleep(0.01)
    io.poll(meta)
    # Written several at once (store.write_inflight): whichever went first is
    # evicted, or, where all three were in flight at once (a loaded machine),
    # the third finds no room (pages being written are not evicted) and is
    # refused. Either way the scheduler hears of the one page the tier lacks.
    assert meta.tier_events[("disk", "stored", 0)] >= 2
    [(tier, evicted)] = meta.removed_pages
    assert tier == "disk" and evicted in {key(i) for i in range(3)} and not meta.is_empty()
    assert not store.contains(evicted)
    assert sum(store.contains(key(i)) for i in range(3)) == 2
    io.close()
