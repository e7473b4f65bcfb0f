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

import os
import threading
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import SMALL, key, page, phys  # noqa: E402
from vllm_kvbm.messages import KVBMWorkerMetadata  # noqa: E402
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
            io.spill(["disk"], key(2), page(2, SMALL))
            # key(0) left the index: its unlink is under way, and blocked
            _until(lambda: evicted not in store._disk.dict, 10, "nothing was evicted")
            assert _returns(lambda: io.poll(meta)), "poll waited on a blocked unlink"
            [(_, _, write)] = io._writing
            assert not write.done()  # the unlink was still blocked meanwhile
        _until(lambda: io.poll(meta) is not None and ("disk", key(2)) in meta.tier_stored,
               40, "the spill never completed")
        assert ("disk", key(0)) in meta.removed_pages
        assert not os.path.exists(store._disk._key_to_path(evicted))
    finally:
        io.close()
