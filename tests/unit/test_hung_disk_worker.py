"""The worker side on a hung disk: vLLM's threads never wait on it.

The disk tier lives on a FUSE mount whose metadata calls block while
``mount.blocked()`` (helpers/blocking_fs.py, 30 s at most): every lookup,
stat, open and unlink under it sleeps, as on a network filesystem whose
server stopped answering. Each test checks that a call made on vLLM's
thread (the worker's poll every step, shutdown) returns while a tier thread
is still stuck in such a call (a bound far below the 30 s block, not a
speed figure), and that the work the stuck call was for still completes
once the mount answers.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import SMALL, key, page, phys  # noqa: E402
from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob  # noqa: E402
from vllm_kvbm.tiers.disk.store import DiskStore  # noqa: E402
from vllm_kvbm.worker.tier_io import TierIO  # noqa: E402

# How long a call on vLLM's thread may take while a tier thread is stuck
# in the filesystem (a blocked call takes 30 s there).
HANG_BOUND_S = 5.0


def _returns(fn, bound: float = HANG_BOUND_S) -> bool:
    """Whether ``fn()`` returns within ``bound`` (it is left running if not)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(bound)


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_poll_returns_while_an_evicted_pages_unlink_is_blocked(mount):
    """A spill into a full disk tier evicts its oldest page, whose unlink
    blocks on the hung mount. The worker's poll (every engine step: it takes
    the pages the disk deleted) returns while that unlink is still blocked;
    once the mount answers, the eviction is reported and the new page stored."""
    store = DiskStore(str(mount.path), 2 * phys(SMALL), SMALL, "ns", 0, 1)
    io = TierIO()
    io.add(store)
    try:
        assert store.put(key(0), page(0, SMALL)) and store.put(key(1), page(1, SMALL))
        evicted = store._ckey(key(0))
        meta = KVBMWorkerMetadata()
        with mount.blocked():
            io.spill(["disk"], [(key(2), page(2, SMALL))])
            # key(0) left the index: its unlink is under way, and blocked
            _until(lambda: evicted not in store._disk.dict, 10, "nothing was evicted")
            assert _returns(lambda: io.poll(meta)), "poll waited on a blocked unlink"
            [(_, _, write)] = io._writing
            assert not write.done()  # the unlink was still blocked meanwhile
        _until(
            lambda: io.poll(meta) is not None and ("disk", key(2)) in meta.tier_stored,
            40,
            "the spill never completed",
        )
        assert ("disk", key(0)) in meta.removed_pages
        assert not os.path.exists(store._disk._key_to_path(evicted))
    finally:
        io.close()


def _pages_beside(mount, n: int) -> list[torch.Tensor]:
    """``n`` pages written straight into the mount's backing directory (fast:
    not through the mount), for a store on the mount to read."""
    writer = DiskStore(str(mount.root), 64 << 20, SMALL, "ns", 0, 1)
    pages = [page(i, SMALL) for i in range(n)]
    try:
        for i, p in enumerate(pages):
            assert writer.put(key(i), p)
    finally:
        writer.close()
    return pages


def _fetch_job(n: int) -> TransferJob:
    return TransferJob(
        1, "R", list(range(n)), list(range(n)), fetch=[(i, "disk", key(i)) for i in range(n)]
    )


def _disk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvbm-disk-")]


def test_an_overdue_fetch_stops_reading(mount, caplog):
    """A fetch whose first page read hangs is reported failed at
    tier_read_timeout_s (vLLM recomputes it), the log saying where the
    tier's threads wait (the page file's open); once that read returns, the
    tier's read thread reads none of the fetch's other pages (they would land
    in slots nobody uses, holding the thread from the next fetch)."""
    n = 8
    _pages_beside(mount, n)
    io = TierIO(read_timeout_s=1.0)
    io.add(DiskStore(str(mount.path), 64 << 20, SMALL, "ns", 0, 1))
    host = torch.zeros((n, SMALL), dtype=torch.uint8)
    job = _fetch_job(n)
    meta, reported, ended = KVBMWorkerMetadata(), [], []
    try:
        with mount.blocked():
            io.fetch(job, host)
            _until(lambda: reported.extend(io.poll(meta)) or reported, 10, "never overdue")
            [(failed, ok, reading, _)] = reported
            assert failed is job and not ok and reading
            [where] = [r.getMessage() for r in caplog.records if "at that moment" in r.getMessage()]
            assert "kvbm-disk-read" in where and "file_io.py" in where, where
        _until(
            lambda: io.poll(meta) is not None and (ended.extend(io.take_ended()) or ended),
            40,
            "the stuck read never ended",
        )
        assert ended == [job]
        assert not any(host[i].any() for i in range(1, n)), "pages read after it was overdue"
    finally:
        io.close()


def test_the_disk_store_reads_no_page_after_stop():
    """get_many_into's ``stop``: checked before each page; the pages after it
    are "skipped" and their slots not written."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for read_inflight in (1, 4):
            s = DiskStore(d, 64 << 20, SMALL, "ns", 0, 1, read_inflight=read_inflight)
            try:
                for i in range(4):
                    assert s.put(key(i), page(i, SMALL))
                outs = [torch.zeros(SMALL, dtype=torch.uint8) for _ in range(4)]
                assert (
                    s.get_many_into([(key(i), o) for i, o in enumerate(outs)], stop=lambda: True)
                    == ["skipped"] * 4
                )
                assert not any(o.any() for o in outs)
                assert (
                    s.get_many_into([(key(i), o) for i, o in enumerate(outs)], stop=lambda: False)
                    == ["ok"] * 4
                )
            finally:
                s.close()


def test_shutdown_leaves_a_read_stuck_on_a_hung_disk_behind(mount, caplog):
    """TierIO.close (the worker's shutdown) waits for a read stuck in a hung
    filesystem for tier_read_timeout_s only, then returns, naming the thread
    it leaves behind in a warning; that thread is a daemon (the process's exit
    does not wait for it either)."""
    _pages_beside(mount, 1)
    io = TierIO(read_timeout_s=1.0)
    io.add(DiskStore(str(mount.path), 64 << 20, SMALL, "ns", 0, 1))
    host = torch.zeros((1, SMALL), dtype=torch.uint8)
    with mount.blocked():
        io.fetch(_fetch_job(1), host)
        _until(lambda: io._fetching[0].futures[0].running(), 10, "the read never started")
        with caplog.at_level(logging.WARNING):
            assert _returns(io.close), "shutdown waited for a read on a hung disk"
        assert "still in a call" in caplog.text and "kvbm-disk-read" in caplog.text
        stuck = [t for t in _disk_threads() if t.is_alive()]
        assert stuck and all(t.daemon for t in stuck)


def test_the_disk_store_closes_while_its_readers_are_stuck(mount):
    """DiskStore.close does not wait without bound for its reader threads
    stuck in a hung filesystem (several pages read in flight)."""
    _pages_beside(mount, 4)
    store = DiskStore(str(mount.path), 64 << 20, SMALL, "ns", 0, 1, read_inflight=4)
    outs = [torch.zeros(SMALL, dtype=torch.uint8) for _ in range(4)]
    with mount.blocked():
        threading.Thread(
            target=lambda: store.get_many_into([(key(i), o) for i, o in enumerate(outs)]),
            daemon=True,
        ).start()
        time.sleep(0.5)  # the readers reach the filesystem (queued, they would be dropped)
        assert _returns(store.close), "close waited for reads on a hung disk"
