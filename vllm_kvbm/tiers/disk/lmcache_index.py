"""LMCache's LocalDiskBackend as the disk tier's index (key -> file, LRU by bytes, eviction).

DiskStore (store.py) writes and reads the page files itself (file_io.py);
this subclass keeps only LMCache's bookkeeping around those writes.
"""

from __future__ import annotations

import functools
import logging
import os
from contextlib import nullcontext

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

        def admit(self, key, size: int) -> str:
            """-> "admitted" (bytes reserved, put task registered), "present",
            "busy" (being written by another thread) or "full"."""
            with self.disk_lock:
                if key in self.dict:
                    self.cache_policy.update_on_hit(key, self.dict)
                    return "present"
                if size > self.max_cache_size:
                    return "full"
                need = self.current_cache_size + size - self.max_cache_size
                if need > 0 and sum(m.size for m in self.dict.values() if m.can_evict) < need:
                    return "full"
                if not self.disk_worker.try_insert_put_task(key):
                    return "busy"
                while self.current_cache_size + size > self.max_cache_size:
                    evict = self.cache_policy.get_evict_candidates(self.dict, num_candidates=1)
                    if not evict:
                        self.disk_worker.remove_put_task(key)
                        return "full"
                    for k in evict:
                        self.current_cache_size -= self.dict[k].size
                    self.batched_remove(evict, force=False)
                self.current_cache_size += size
                self.cache_policy.update_on_put(key)
                return "admitted"

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
            with self.disk_lock if force else nullcontext():
                meta = self.dict.pop(key, None)
                if meta is None:
                    return False
                if force:  # eviction already took the size off before calling us
                    self.current_cache_size -= meta.size
                self.usage -= meta.size
                try:
                    os.remove(meta.path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("disk tier: could not delete %s: %s", meta.path, e)
                if force:
                    self.cache_policy.update_on_force_evict(key)
                self.removed.append(key.chunk_hash)  # reported to the scheduler
            return True

    return _KvbmDiskBackend
