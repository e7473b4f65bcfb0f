"""The disk tier: one file per page in a directory, LRU by bytes, on LMCache's LocalDiskBackend.

Used from the worker process; the caller owns the threads. Every method may
block, but for a bounded time, and none raises.

LMCache behaviour worked around here (0.5.6), each next to its call:
- LocalDiskBackend writes asynchronously and silently drops failed writes
  (leaking their accounting); we wait for each write and undo a failed one.
  It writes the final file name in place; we write ``<name>.tmp`` and rename.
- Its reads ignore short and missing files (returning stale staging memory);
  ours raise, so truncation is "corrupt" and a deleted file is "miss".
- Its explicit remove() does not give back the bytes to its capacity count.
- Its index lives in memory only; we rebuild it from the directory.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import stat
import tempfile
import threading
import time
from contextlib import nullcontext

import torch

from vllm_kvbm.config import KVBMConfigError, disk_tier_too_small
from vllm_kvbm.tiers.lmcache_store import GIB, LMCacheStore, start_loop, stop_loop
from vllm_kvbm.tiers.page_format import (KEY_BYTES, flat_u8, retired_model_names, valid_key,
                                         valid_page)

logger = logging.getLogger(__name__)


class _ShortFile(Exception):
    pass


class _NoStaging(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _disk_backend_class():
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    class _KvbmDiskBackend(LocalDiskBackend):
        """LocalDiskBackend whose I/O failures are reported instead of ignored."""

        def write_file(self, buffer, path):
            tmp = path + ".tmp"
            try:
                # Owner-only, never through a symlink someone planted: the
                # directory may be shared (see DiskStore's directory lock).
                try:
                    os.unlink(tmp)  # a crash's leftover (removes a link, not its target)
                except FileNotFoundError:
                    pass
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(buffer)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
                raise

        def async_save_bytes_to_disk(self, key, memory_obj, on_complete_callback=None):
            size = memory_obj.get_physical_size()
            md = memory_obj.metadata
            shape, dtype, fmt = md.shape, md.dtype, md.fmt
            err = None
            try:
                self.write_file(memory_obj.byte_array, self._key_to_path(key))
            except BaseException as e:  # noqa: BLE001 - ENOSPC, EIO, ...
                err = e
            finally:
                memory_obj.ref_count_down()
            if err is None:
                self.insert_key(key, size, shape, dtype, fmt)
                self.usage += size
            else:
                with self.disk_lock:
                    self.current_cache_size -= size  # admitted in submit_put_task
            self.disk_worker.remove_put_task(key)
            if on_complete_callback is not None:
                on_complete_callback(key, err)

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

        def load_bytes_from_disk(self, key, path, dtype, shape, fmt):
            mo = self.local_cpu_backend.allocate(shape, dtype, fmt, busy_loop=False)
            if mo is None:
                raise _NoStaging()
            try:
                view = memoryview(mo.byte_array).cast("B")
                try:  # FileNotFoundError propagates: a miss
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError as e:
                    if e.errno != errno.ELOOP:
                        raise
                    raise _ShortFile(f"{path}: a symlink, not a page file") from None
                with os.fdopen(fd, "rb", buffering=0) as f:
                    got = 0
                    while got < len(view):
                        n = f.readinto(view[got:])
                        if not n:
                            break
                        got += n
                    extra = f.read(1)
                if got != len(view) or extra:
                    raise _ShortFile(f"{path}: {got}{'+' if extra else ''} of {len(view)} bytes")
            except BaseException:
                mo.ref_count_down()
                raise
            return mo

    return _KvbmDiskBackend


class _PutWaiter:
    def __init__(self):
        self.event = threading.Event()
        self.error = None

    def __call__(self, key, err=None):
        self.error = err
        self.event.set()


def _prepare_dir(directory: str) -> str:
    d = os.path.abspath(os.path.expanduser(directory))
    fix = "set disk_cache_dir to a writable local directory (or fix its permissions)"
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise KVBMConfigError(
            f"disk_cache_dir: cannot create directory {d!r} ({e.strerror or e}); {fix}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvbm-probe-", dir=d)
        try:
            os.write(fd, b"kvbm")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise KVBMConfigError(
            f"disk_cache_dir: directory {d!r} is not writable ({e.strerror or e}); {fix}") from None
    return d


def _claim(directory: str, owner: str) -> int:
    """Locks ``directory`` for one store (namespace and rank); refuses a second."""
    path = os.path.join(directory, f".kvbm-{owner}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise KVBMConfigError(
            f"disk_cache_dir: {directory!r} is in use by another engine (pid {holder}) for "
            f"the same model, KV format and TP rank; two of them would evict each other's "
            f"pages. Give each engine its own disk_cache_dir (engines of different models "
            f"may share one)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class DiskStore(LMCacheStore):
    """Pages as files in ``directory`` via LMCache's LocalDiskBackend (LRU by bytes).

    Each page costs ``block_bytes + HEADER_BYTES`` (96) rounded up to 4 KiB of the capacity.
    A new instance on the same directory adopts the pages left there by an
    earlier one (same namespace, rank and world size), newest first up to the
    capacity; older surplus files are deleted, and so are this namespace's
    files of an older page format version. With ``page_secret`` pages carry
    a MAC and a page without a valid one reads as "unauthenticated" (removed).

    A directory may be shared by engines of different models (or block
    sizes, dtypes, ...): each store counts, evicts and adopts only its own
    namespace's files. Two live stores of the same namespace and rank would
    evict each other's files and count the same bytes twice, so each holds
    an exclusive lock on ``.kvbm-<namespace>@<world>@<rank>.lock`` for its
    lifetime and a second one is refused at startup. Page files are created
    0600 and never opened through a symlink.
    """

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, namespace: str,
                 rank: int, world_size: int, *, io_timeout_s: float = 30.0, max_inflight: int = 8,
                 page_secret: bytes | None = None):
        super().__init__(block_bytes, namespace, rank, world_size, page_secret)
        self._retired = tuple(f"{m}@{world_size}@{rank}@"
                              for m in retired_model_names(namespace, block_bytes))
        if capacity_bytes < self._phys:
            raise disk_tier_too_small(capacity_bytes, self._phys)
        self.directory = _prepare_dir(directory)
        self._lock_fd = _claim(self.directory, f"{self._model}@{world_size}@{rank}")
        try:
            self.capacity_bytes = int(capacity_bytes)
            self._io_timeout_s = io_timeout_s
            from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

            cfg = self._Config.from_defaults(
                chunk_size=1, local_cpu=False,
                # staging only; slack in case the allocator aligns more coarsely
                max_local_cpu_size=((max_inflight + 2) * self._phys + 8 * 1024**2) / GIB,
                local_disk=self.directory, max_local_disk_size=self.capacity_bytes / GIB)
            self._slots = threading.BoundedSemaphore(max_inflight)  # staging users (put + get)
            self._loop, self._thread = start_loop("kvbm-disk-io")
            self._staging = LocalCPUBackend(cfg, self._md)
            self._disk = _disk_backend_class()(cfg, self._loop, self._staging, dst_device="cpu",
                                               metadata=self._md)
            self._disk.max_cache_size = self.capacity_bytes  # exact, not via float GiB
            self._disk.removed = []  # chunk hashes of deleted pages (LRU, damage)
            self._closed = False
            probe = self._staging.allocate(self._shape, torch.uint8, self._fmt, busy_loop=False)
            if probe is None:
                self.close()
                raise RuntimeError("disk tier: cannot allocate LMCache staging memory")
            self._phys = probe.get_physical_size()  # what LMCache charges per page
            probe.ref_count_down()
            self._writes_failing = False
            self.adopted = self._adopt_existing()
        except BaseException:
            self._release_lock()
            raise

    # -- restart ----------------------------------------------------------
    def _adopt_existing(self) -> int:
        prefix = f"{self._model}@{self._world_size}@{self._rank}@"
        found = []
        for fn in os.listdir(self.directory):
            if fn.startswith(self._retired) and fn.endswith((".pt", ".tmp")):
                self._unlink(os.path.join(self.directory, fn))  # an older page format
                continue
            if not fn.startswith(prefix):
                continue  # another namespace/rank, or not ours at all
            path = os.path.join(self.directory, fn)
            if fn.endswith(".tmp"):  # an interrupted write
                self._unlink(path)
                continue
            if not fn.endswith(".pt"):
                continue
            try:
                k = self._parse_cache_key(fn[:-3])
                h = int(k.chunk_hash)
                if not (0 <= h < 1 << 256) or k.dtype != torch.uint8:
                    continue
                key = h.to_bytes(KEY_BYTES, "big")
                if self._disk._key_to_path(self._ckey(key)) != path:
                    continue
                st = os.lstat(path)
            except Exception:  # noqa: BLE001 - not a name we wrote
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != self._codec.stored_bytes:
                self._unlink(path)  # ours but truncated/garbled
                continue
            found.append((st.st_mtime_ns, fn, key, path))
        found.sort()
        keep, total = [], 0
        for entry in reversed(found):  # newest first
            if total + self._phys <= self.capacity_bytes:
                keep.append(entry)
                total += self._phys
            else:
                self._unlink(entry[3])
        for _, _, key, _ in reversed(keep):  # oldest first = front of the LRU
            self._disk.insert_key(self._ckey(key), self._phys, self._shape, torch.uint8, self._fmt)
            with self._disk.disk_lock:
                self._disk.current_cache_size += self._phys
            self._disk.usage += self._phys
        if keep:
            logger.info("disk tier: adopted %d pages (%d bytes) from %s", len(keep), total,
                        self.directory)
        return len(keep)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    # -- API ---------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        try:
            return self._put(bytes(key), page)
        except Exception as e:  # noqa: BLE001 - never raises
            logger.warning("disk tier: put failed: %s", e)
            return False

    def _put(self, key: bytes, page: torch.Tensor) -> bool:
        if self._closed or not valid_key(key) or not valid_page(page, self.block_bytes):
            return False
        deadline = time.monotonic() + self._io_timeout_s
        if not self._slots.acquire(timeout=self._io_timeout_s):
            return False
        try:
            ck = self._ckey(key)
            mo = self._staging.allocate(self._shape, torch.uint8, self._fmt, busy_loop=False)
            if mo is None:
                return False
            waiter = _PutWaiter()
            try:
                self._codec.encode_into(flat_u8(mo.tensor), key, page)
                self._disk.submit_put_task(ck, mo, on_complete_callback=waiter)
            finally:
                mo.ref_count_down()  # the write task holds its own reference
            # Refused puts (full of pinned pages, already present, in flight
            # elsewhere) never call back: judge them by the final state.
            while True:
                if waiter.event.is_set():
                    self._note_write(waiter.error)
                    return waiter.error is None
                if not self._disk.exists_in_put_tasks(ck):
                    if waiter.event.is_set():
                        continue
                    return self._disk.contains(ck)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False  # still being written; it may appear later
                waiter.event.wait(min(left, 0.005))
        finally:
            self._slots.release()

    def _note_write(self, err) -> None:
        if err is not None and not self._writes_failing:
            self._writes_failing = True
            logger.warning("disk tier: writes to %s failing (%s); puts return False until "
                           "one succeeds", self.directory, err)
        elif err is None and self._writes_failing:
            self._writes_failing = False
            logger.warning("disk tier: writes to %s succeed again", self.directory)

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        try:
            if not self._slots.acquire(timeout=self._io_timeout_s):
                return "error"
            try:
                return self._get_into(bytes(key), out)
            finally:
                self._slots.release()
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: get failed: %s", e)
            return "error"

    def _get_into(self, key: bytes, out: torch.Tensor) -> str:
        if self._closed or not valid_key(key) or not valid_page(out, self.block_bytes):
            return "error"
        ck = self._ckey(key)
        try:
            mo = self._disk.get_blocking(ck)
        except FileNotFoundError:
            self._disk.remove(ck)  # deleted behind our back: forget it
            return "miss"
        except _ShortFile as e:
            logger.warning("disk tier: truncated page removed: %s", e)
            self._disk.remove(ck)
            return "corrupt"
        except _NoStaging:
            return "error"
        if mo is None:
            return "miss"
        try:
            status = self._codec.decode_into(flat_u8(mo.tensor), key, out)
        finally:
            mo.ref_count_down()
        if status == "corrupt":
            logger.warning("disk tier: corrupt page removed: %s", self._disk._key_to_path(ck))
            self._disk.remove(ck)
        elif status == "unauthenticated":
            logger.warning("disk tier: page without a valid MAC (not written with this "
                           "deployment's page secret) removed: %s", self._disk._key_to_path(ck))
            self._disk.remove(ck)
        elif status == "ok":
            try:  # persist recency for the LRU order after a restart
                os.utime(self._disk._key_to_path(ck))
            except OSError:
                pass
        return status

    def contains(self, key: bytes) -> bool:
        try:
            return (not self._closed and valid_key(key)
                    and self._disk.contains(self._ckey(bytes(key))))
        except Exception:  # noqa: BLE001
            return False

    def take_removed(self) -> list[bytes]:
        # Under the lock its appends hold: the reader and the writer thread
        # (and LMCache's eviction) delete pages while the worker polls.
        with self._disk.disk_lock:
            removed, self._disk.removed = self._disk.removed, []
        return [int(h).to_bytes(KEY_BYTES, "big") for h in removed]

    def remove(self, key: bytes) -> None:
        try:
            if valid_key(key):
                self._disk.remove(self._ckey(bytes(key)))
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: remove failed: %s", e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._disk.close()  # waits for queued writes
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: close: %s", e)
        if stop_loop(self._loop, self._thread, 5.0):
            try:
                self._staging.close()
            except Exception:  # noqa: BLE001
                pass
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the directory lock
            self._lock_fd = -1
