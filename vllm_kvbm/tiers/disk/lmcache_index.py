"""LMCache's LocalDiskBackend as the disk tier's index (key -> file, LRU by bytes, eviction).

DiskStore (store.py) writes and reads the page files itself (file_io.py);
this subclass keeps only LMCache's bookkeeping around those writes.

No file is deleted under ``disk_lock``: a page leaves the index under it and
its file is unlinked after, on the thread that removed it (a writer evicting
for room, a reader dropping a damaged page), so a slow or hung unlink holds
that one thread, never the lock. A key whose file is still being unlinked is
"busy" to admit until it is gone (a new file of that key is never deleted
by an old eviction). Deleted pages are reported through ``on_removed``.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _disk_backend_class():
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    class _KvbmDiskBackend(LocalDiskBackend):
        """LocalDiskBackend as the index of the files DiskStore writes and reads itself.

        admit/commit/abort are submit_put_task's admission (LRU eviction by
        bytes) and async_save_bytes_to_disk's bookkeeping, with the write in
        between done by the caller on its own thread.
        """

        # Called with the chunk hash of each page deleted (eviction, damage),
        # after its file is unlinked, on the thread that deleted it.
        on_removed = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unlinking: dict = {}  # key -> its file: left the index, not unlinked yet

        def admit(self, key, size: int) -> str:
            """-> "admitted" (bytes reserved, put task registered), "present",
            "busy" (being written by another thread, or its old file still
            being deleted) or "full". Evicted pages' files are deleted here,
            after the lock is released."""
            doomed = []
            try:
                with self.disk_lock:
                    if key in self.dict:
                        self.cache_policy.update_on_hit(key, self.dict)
                        return "present"
                    if key in self.unlinking:
                        return "busy"
                    if size > self.max_cache_size:
                        return "full"
                    need = self.current_cache_size + size - self.max_cache_size
                    if need > 0 and not self._can_free(need):
                        return "full"
                    if not self.disk_worker.try_insert_put_task(key):
                        return "busy"
                    while self.current_cache_size + size > self.max_cache_size:
                        evict = self.cache_policy.get_evict_candidates(self.dict, num_candidates=1)
                        if not evict:
                            self.disk_worker.remove_put_task(key)
                            return "full"
                        # eviction: not update_on_force_evict (LMCache's remove(force=False))
                        doomed += [self._forget(k, force=False) for k in evict]
                    self.current_cache_size += size
                    self.cache_policy.update_on_put(key)
                    return "admitted"
            finally:
                self._unlink(doomed)

        def _can_free(self, need: int) -> bool:
            """Whether evicting would free ``need`` bytes: stops at the first
            pages that do (LMCache sums every page's size, O(pages) a put)."""
            for meta in self.dict.values():
                if meta.can_evict:
                    need -= meta.size
                    if need <= 0:
                        return True
            return False

        def commit(self, key, size: int, shape, dtype, fmt) -> None:
            self.insert_key(key, size, shape, dtype, fmt)
            with self.disk_lock:  # several writer threads commit at once
                self.usage += size
            self.disk_worker.remove_put_task(key)

        def abort(self, key, size: int) -> None:
            with self.disk_lock:
                self.current_cache_size -= size
            self.disk_worker.remove_put_task(key)

        def where(self, key, hit: bool = False) -> str | None:
            """The page file of ``key`` (None: not stored); ``hit`` moves it
            to the recent end of the LRU."""
            with self.disk_lock:
                meta = self.dict.get(key)
                if meta is None:
                    return None
                if hit:
                    self.cache_policy.update_on_hit(key, self.dict)
                return meta.path

        def remove(self, key, force=True):
            with self.disk_lock:
                doomed = self._forget(key, force)
            self._unlink([doomed])
            return doomed is not None

        def _forget(self, key, force: bool):
            """Takes ``key`` out of the index (under disk_lock; no I/O) ->
            (key, path) to unlink, None when it was not there."""
            meta = self.dict.pop(key, None)
            if meta is None:
                return None
            self.current_cache_size -= meta.size
            self.usage -= meta.size
            if force:
                self.cache_policy.update_on_force_evict(key)
            self.unlinking[key] = meta.path
            return key, meta.path

        def _unlink(self, doomed) -> None:
            """Deletes forgotten pages' files (off disk_lock) and reports them."""
            for item in doomed:
                if item is None:
                    continue
                key, path = item
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("disk tier: could not delete a page file: %s", e.strerror)
                finally:
                    # Reported before the key may be admitted again (see DiskStore._put).
                    if self.on_removed is not None:
                        self.on_removed(key.chunk_hash)
                    with self.disk_lock:
                        self.unlinking.pop(key, None)

    return _KvbmDiskBackend
