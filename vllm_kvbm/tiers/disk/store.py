"""The disk tier: one file per page in a directory, LRU by bytes, indexed by LMCache's LocalDiskBackend.

Used from the worker process; the caller owns the threads (TierIO: a read
thread and a write thread per tier). Every method may block, for as long as
the filesystem takes to read or write one page, and none raises.
The page files' raw I/O is in file_io.py, LMCache's index subclass in
lmcache_index.py, the scheduler's view of the directory in view.py.

What LMCache does here and what goes around it (LMCache 0.5.6). LMCache's
LocalDiskBackend keeps the index: the key -> file table, the LRU order by
bytes, admission and eviction (whose deletions we report, take_removed). The
bytes go around it: put writes the page file itself, on the caller's thread
(one of TierIO's writer threads), header and payload straight from the caller's
tensor (encrypted through a scratch buffer under a page secret), 1 MiB per
call; get_into reads a page in the page cache straight into the caller's
slot, 1 MiB at a time, each chunk checksummed (or decrypted in place under a
page secret) right after it is read while it is still in the CPU's cache,
and a page that is not with O_DIRECT (the device DMAs it into an aligned
buffer, where it is checked, then copied or decrypted into the slot);
get_many_into does that for several pages in flight. LMCache's byte path
staged every page in its own CPU memory (a copy in and a copy out), sent each
write through its asyncio loop to its disk worker threads, and allocated
staging memory per read.
LMCache's NixlStorageBackend (NIXL POSIX) stages the same way and keeps
pages in a pool of preallocated files indexed in memory only, so nothing
survives a restart. Figures for all of them against a plain read and write
of the same bytes: benchmarks/bench_disk.py, docs/benchmarks.md.

LMCache behaviour still worked around, each next to its code:
- Its writes go to the final name in place and a failed one is dropped
  silently, its bytes still counted; ours write ``<name>.tmp`` (0600,
  O_EXCL|O_NOFOLLOW) and rename, and a failed one gives its bytes back
  (admit/commit/abort around the write).
- Its reads ignore short and missing files; ours see them: truncation is
  "corrupt" and a deleted file is "miss".
- Its explicit remove() does not give back the bytes to its capacity count.
- Its index lives in memory only; we rebuild it from the directory.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.config import disk_tier_too_small
from vllm_kvbm.cpus import widen_thread_affinity
from vllm_kvbm.io_threads import IOThreads, close_pools
from vllm_kvbm.tiers.disk.file_io import (
    _SYS_CACHESTAT,
    _allows_o_direct,
    _Bounce,
    _claim,
    _Out,
    _prepare_dir,
    _read_page,
    _ShortFile,
    _write_page,
)
from vllm_kvbm.tiers.disk.lmcache_index import _disk_backend_class
from vllm_kvbm.tiers.disk.page_slices import PageSlices, open_slices
from vllm_kvbm.tiers.disk.view import replica_directory
from vllm_kvbm.tiers.lmcache_store import GIB, LMCacheStore, start_loop, stop_loop
from vllm_kvbm.tiers.page_format import KEY_BYTES, retired_model_names, valid_key, valid_page

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

# What close waits for reads in flight (seconds) before leaving them behind.
_CLOSE_WAIT_S = 1.0


class DiskStore(LMCacheStore):
    """Pages as files in ``directory`` via LMCache's LocalDiskBackend (LRU by bytes).

    Each page costs ``page_bytes + HEADER_BYTES`` (96) rounded up to 4 KiB of the capacity.
    A new instance on the same directory adopts the pages left there by an
    earlier one (same namespace, rank and world size), newest first up to the
    capacity; older surplus files are deleted, and so are this namespace's
    files of an older page format version. With ``page_secret`` pages are
    sealed (encrypted and authenticated) and named by keyed hashes, and a
    page that does not open reads as "unauthenticated" (removed).

    A directory may be shared by engines of different models (or block
    sizes, dtypes, ...): each store counts, evicts and adopts only its own
    namespace's files. Two live stores of the same namespace and rank would
    evict each other's files and count the same bytes twice, so each holds
    an exclusive lock on ``.kvbm-<namespace>@<world>@<rank>.lock`` for its
    lifetime and a second one is refused at startup (data-parallel ranks,
    which share keys, each get a directory of their own: from_config,
    view.replica_directory). Page files are created 0600 and never opened
    through a symlink.
    """

    name = "disk"

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", rank: int, secret: bytes | None, layout: str
    ) -> "DiskStore":
        return cls(
            replica_directory(config.disk_cache_dir, info.data_parallel_index),
            config.disk_cache_bytes,
            info.page_bytes,
            info.tier_namespace,
            rank,
            info.key_namespace.tp_size,
            page_secret=secret,
            layout=layout,
        )

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        page_bytes: int,
        namespace: str,
        rank: int,
        world_size: int,
        *,
        io_timeout_s: float = 30.0,
        max_inflight: int = 8,
        read_inflight: int = 4,
        write_inflight: int = 4,
        page_secret: bytes | None = None,
        direct_reads: bool = True,
        layout: str = "",
    ):
        super().__init__(page_bytes, namespace, rank, world_size, page_secret, layout)
        # Keys of the pages this store put or read, by their names' chunk
        # hash: under a page secret names are keyed hashes, so take_removed
        # cannot turn a removed page's name back into its key otherwise
        # (pages adopted at startup and never touched are not reported: this
        # scheduler never wrote them).
        self._keys: dict[int, bytes] = {}
        # Keys of the pages deleted since take_removed last ran: appended on
        # the tier's threads, taken on vLLM's without a lock (deque).
        self._removed: deque[bytes] = deque()
        self._retired = tuple(
            f"{m}@{world_size}@{rank}@" for m in retired_model_names(namespace, page_bytes)
        )
        if capacity_bytes < self._phys:
            raise disk_tier_too_small(capacity_bytes, self._phys)
        self.directory = _prepare_dir(directory)
        self._lock_fd = _claim(self.directory, f"{self._model}@{world_size}@{rank}")
        try:
            self.capacity_bytes = int(capacity_bytes)
            self._io_timeout_s = io_timeout_s
            from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

            cfg = self._Config.from_defaults(
                chunk_size=1,
                local_cpu=False,
                # One page: the probe below (pages never pass through LMCache
                # memory); slack in case the allocator aligns more coarsely.
                max_local_cpu_size=(self._phys + 8 * 1024**2) / GIB,
                local_disk=self.directory,
                max_local_disk_size=self.capacity_bytes / GIB,
            )
            self._slots = threading.BoundedSemaphore(max_inflight)  # pages in flight (put + get)
            # TierIO's writer threads for this store: puts of different keys
            # run in parallel (one key's second put waits for its first, see
            # admit): 0.76-0.78x of a sequential write against 0.57-0.61x one at a time
            # (benchmarks/bench_disk.py).
            self.write_inflight = max(1, min(write_inflight, max_inflight - read_inflight))
            # Pages not in the page cache are read with O_DIRECT where allowed.
            self._direct = (
                direct_reads and _SYS_CACHESTAT is not None and _allows_o_direct(self.directory)
            )
            self._bounces = threading.local()
            # get_many_into's readers: several reads in flight keep the device
            # queue busy (cold) and verify on both cores (warm).
            self._read_inflight = read_inflight
            self._readers = (
                IOThreads(read_inflight, "kvbm-disk-read", widen_thread_affinity)
                if read_inflight > 1
                else None
            )
            self._loop, self._thread = start_loop("kvbm-disk-io")
            self._staging = LocalCPUBackend(cfg, self._md)
            self._disk = _disk_backend_class()(
                cfg, self._loop, self._staging, dst_device="cpu", metadata=self._md
            )
            self._disk.max_cache_size = self.capacity_bytes  # exact, not via float GiB
            self._disk.on_removed = self._on_removed  # deleted pages (LRU, damage)
            self._closed = False
            probe = self._staging.allocate(self._shape, torch.uint8, self._fmt, busy_loop=False)
            if probe is None:
                self.close()
                raise RuntimeError("disk tier: cannot allocate LMCache staging memory")
            # What LMCache charges per page: the disk accounting unit, checked
            # against config's formula by a test.
            self._phys = probe.get_physical_size()
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
                if self._disk._key_to_path(self._ckey_of(h)) != path:
                    continue
                st = os.lstat(path)
            except Exception:  # noqa: BLE001 - not a name we wrote
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != self._codec.stored_bytes:
                self._unlink(path)  # ours but truncated/garbled
                continue
            found.append((st.st_mtime_ns, fn, h, path))
        found.sort()
        keep, total = [], 0
        for entry in reversed(found):  # newest first
            if total + self._phys <= self.capacity_bytes:
                keep.append(entry)
                total += self._phys
            else:
                self._unlink(entry[3])
        for _, _, h, _ in reversed(keep):  # oldest first = front of the LRU
            self._disk.insert_key(self._ckey_of(h), self._phys, self._shape, torch.uint8, self._fmt)
            with self._disk.disk_lock:
                self._disk.current_cache_size += self._phys
            self._disk.usage += self._phys
        if keep:
            logger.info(
                "disk tier: adopted %d pages (%d bytes) from %s", len(keep), total, self.directory
            )
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
        if self._closed or not valid_key(key) or not valid_page(page, self.page_bytes):
            return False
        deadline = time.monotonic() + self._io_timeout_s
        if not self._slots.acquire(timeout=self._io_timeout_s):
            return False
        try:
            ck = self._ckey(key)
            self._note_key(ck, key)
            page = page.contiguous()
            while True:
                admitted = self._disk.admit(ck, self._phys)
                if admitted != "busy":
                    break
                # Another thread is writing this key: its result is ours.
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
            if admitted != "admitted":
                return admitted == "present"
            self._note_key(ck, key)  # again: an older eviction of it may have dropped it
            try:
                # From the caller's page where it lies, CRC (and MAC) as it goes.
                _write_page(self._disk._key_to_path(ck), self._codec, key, page)
            except BaseException as e:  # noqa: BLE001 - ENOSPC, EIO, a removed directory...
                self._disk.abort(ck, self._phys)
                self._note_write(e)
                return False
            self._disk.commit(ck, self._phys, self._shape, torch.uint8, self._fmt)
            self._note_write(None)
            return True
        finally:
            self._slots.release()

    def _note_write(self, err) -> None:
        if err is not None and not self._writes_failing:
            self._writes_failing = True
            logger.warning(
                "disk tier: writes to %s failing (%s); puts return False until one succeeds",
                self.directory,
                err,
            )
        elif err is None and self._writes_failing:
            self._writes_failing = False
            logger.warning("disk tier: writes to %s succeed again", self.directory)

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        return self._get(self._target(key, out))

    def _target(self, key, out: torch.Tensor) -> "tuple[bytes, _Out] | None":
        """``(key, out)`` checked and made ready for a reader thread (no torch
        there); None when either is not a key or a page of this store."""
        try:
            if valid_key(key) and valid_page(out, self.page_bytes) and out.is_contiguous():
                return bytes(key), _Out(out)
        except Exception as e:  # noqa: BLE001 - never raises
            logger.warning("disk tier: get failed: %s", e)
        return None

    def _get(self, target: "tuple[bytes, _Out] | None") -> str:
        if target is None or self._closed:
            return "error"
        try:
            if not self._slots.acquire(timeout=self._io_timeout_s):
                return "error"
            try:
                return self._read(*target)
            finally:
                self._slots.release()
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: get failed: %s", e)
            return "error"

    def _read(self, key: bytes, out: "_Out") -> str:
        # Straight into the slot, checked chunk by chunk as it arrives: a page
        # that fails leaves the slot written but unused (the load fails and
        # the scheduler drops the slot; test_page_auth, test_worker_tiers).
        def read(path, judge):
            status = _read_page(path, self._codec, key, out, touch=True, bounce=self._bounce())
            return judge(status)

        return self._open_file(key, read)

    def _open_file(self, key: bytes, read):
        """``read(path, judge)`` on ``key``'s page file, ``judge`` turning a
        status into the store's; or "miss" (no file, or one deleted behind our
        back: forgotten) or "corrupt" (truncated or a symlink: removed)."""
        ck = self._ckey(key)
        # the LRU order moves at the lookup (one lock); a page that fails goes
        path = self._disk.where(ck, hit=True)
        if path is None:
            return "miss"
        self._note_key(ck, key)
        try:
            return read(path, lambda status: self._judge(ck, path, status))
        except FileNotFoundError:
            self._disk.remove(ck)  # deleted behind our back: forget it
            return "miss"
        except _ShortFile as e:
            logger.warning("disk tier: truncated page removed: %s", e)
            self._disk.remove(ck)
            return "corrupt"

    def _judge(self, ck, path: str, status: str) -> str:
        """A read's status; a corrupt or unauthenticated page removed (said once)."""
        if status == "corrupt":
            logger.warning("disk tier: corrupt page removed: %s", path)
            self._disk.remove(ck)
        elif status == "unauthenticated":
            logger.warning(
                "disk tier: page without a valid MAC (not written with this "
                "deployment's page secret) removed: %s",
                path,
            )
            self._disk.remove(ck)
        return status

    def open_slices(self, key: bytes, out: torch.Tensor) -> "PageSlices | str":
        """``key``'s page opened for ranged reads into ``out`` (its host slot),
        layer by layer (page_slices.py), or the status that decides it now
        ("miss", "corrupt", "error", ...). On the caller's thread, never vLLM's."""
        target = self._target(key, out)
        if target is None or self._closed:
            return "error"
        key, slot = target
        try:
            return self._open_file(
                key, lambda path, judge: open_slices(path, self._codec, key, slot.view, judge)
            )
        except Exception as e:  # noqa: BLE001 - never raises
            logger.warning("disk tier: get failed: %s", e)
            return "error"

    def _bounce(self) -> "_Bounce | None":
        """This thread's O_DIRECT buffer; None where the filesystem refuses O_DIRECT."""
        if not self._direct:
            return None
        bounce = getattr(self._bounces, "buf", None)
        if bounce is None:
            bounce = self._bounces.buf = _Bounce(self._codec.stored_bytes)
        return bounce

    def get_many_into(self, items: list[tuple[bytes, torch.Tensor]], stop=None) -> list[str]:
        """get_into for each ``(key, out)``, several in flight; the statuses in
        order ("skipped": not read, ``stop()`` having turned true)."""
        targets = [self._target(key, out) for key, out in items]  # torch here, not there

        def read(part):
            return [self._get(t) if stop is None or not stop() else "skipped" for t in part]

        if self._readers is None or len(items) < 2 or self._closed:
            return read(targets)
        # One task per reader, each a stride of the pages: a future per page
        # cost warm reads 4 in flight ~13% here (GIL round trips).
        k = min(self._read_inflight, len(targets))
        try:
            tasks = [self._readers.submit(read, targets[j::k]) for j in range(k)]
            statuses: list[str] = [""] * len(targets)
            for j, task in enumerate(tasks):
                statuses[j::k] = task.result()
            return statuses
        except Exception as e:  # noqa: BLE001 - e.g. closed under us
            logger.warning("disk tier: get failed: %s", e)
            return ["error"] * len(items)

    def contains(self, key: bytes) -> bool:
        try:
            return (
                not self._closed and valid_key(key) and self._disk.contains(self._ckey(bytes(key)))
            )
        except Exception:  # noqa: BLE001
            return False

    def _note_key(self, ck, key: bytes) -> None:
        if self._codec.keyed:
            self._keys[int(ck.chunk_hash)] = key

    def _on_removed(self, chunk_hash) -> None:
        """A page's file was deleted (on the thread that deleted it)."""
        if not self._codec.keyed:
            self._removed.append(int(chunk_hash).to_bytes(KEY_BYTES, "big"))
            return
        key = self._keys.pop(int(chunk_hash), None)
        if key is not None:
            self._removed.append(key)

    def usage(self) -> tuple[int, int]:
        return int(self._disk.current_cache_size), self.capacity_bytes

    def take_removed(self) -> list[bytes]:
        # Called on vLLM's worker thread every step: no lock, no file.
        keys = []
        while self._removed:
            keys.append(self._removed.popleft())
        return keys

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
        if self._readers is not None:
            # They serve get_many_into calls only, which the caller (TierIO)
            # waited for with its own deadline.
            close_pools([self._readers], _CLOSE_WAIT_S, "disk tier")
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
