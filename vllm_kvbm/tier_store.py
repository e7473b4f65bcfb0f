"""Lower KV tiers below host RAM: local disk and a remote cache server.

Both stores keep our pages (one KV block = a flat uint8 page of
``block_bytes``) in LMCache 0.5.6 storage backends: ``LocalDiskBackend``
(files, LRU eviction by bytes) and ``RemoteBackend`` over the ``lm://``
protocol of ``python -m lmcache.v1.server HOST PORT``. They are used from
the worker process; the caller owns the threads. Every method may block, but
for a bounded time, and none raises.

Each stored page is ``HEADER (64 B) + payload``. The header holds a magic, a
format version, the checksum algorithm, flags, the payload length, a hash of
the namespace and the full 32-byte key; its last field is a CRC over the rest
of the header and the payload. ``get_into`` checks all of them, so a flipped
byte, a truncated file, or a page filed under another key or namespace is
reported as "corrupt" (and removed), never as "ok".

Checksum: CRC-32C through the hardware-accelerated libcrc32c that ships with
google-crc32c (an LMCache dependency), called on the tensor memory without a
copy (about 19 GB/s on a 2 MiB page here, against about 2.5 GB/s for
zlib.crc32 and 2.9 GB/s for zlib.adler32). Where that library is missing,
zlib.crc32 is written instead; the header names the algorithm, so a reader
verifies either.

The namespace (model, dtype, layout, ... as given by the caller) and the
block size are hashed into the LMCache model name ``kvbm_<16 hex>`` (LMCache
keys are limited to 150 characters), so another namespace never matches a
key; the same hash is also checked in the header.

LMCache behaviour worked around here (0.5.6):
- LocalDiskBackend writes asynchronously and silently drops failed writes
  (leaking their accounting); we wait for each write and undo a failed one.
  It writes the final file name in place; we write ``<name>.tmp`` and rename.
- Its reads ignore short and missing files (returning stale staging memory);
  ours raise, so truncation is "corrupt" and a deleted file is "miss".
- Its explicit remove() does not give back the bytes to its capacity count.
- Its index lives in memory only; we rebuild it from the directory.
- The lm:// connector has no timeouts, no delete, swallows errors in
  contains()/get_blocking() and desynchronises its stream after any error.
  We set a socket timeout, call the connector directly, and after any error
  or timeout drop the whole connection (its own event loop and staging
  memory included) and open a new one lazily, at most once per
  ``retry_interval_s``. Delete is emulated by overwriting with a tombstone.
- lm:// PUT has no reply: put() confirms with an EXIST on the same stream.
- A PUT cut off mid-page leaves an entry on LMCache's server whose GET makes
  the server hang up; keys whose PUT was cut off or whose GET broke the
  stream are overwritten with a tombstone when the store reconnects.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import glob
import hashlib
import logging
import os
import re
import select
import socket
import struct
import tempfile
import threading
import time
import zlib
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext

import torch

from vllm_kvbm.config import KVBMConfigError, disk_tier_too_small

logger = logging.getLogger(__name__)

__all__ = ["TierStore", "DiskStore", "RemoteStore", "HEADER_BYTES", "disk_page_path"]

# ---------------------------------------------------------------------------
# Page format
# ---------------------------------------------------------------------------

_MAGIC = b"KVBT"
_VERSION = 1
_ALG_CRC32 = 1     # zlib.crc32
_ALG_CRC32C = 2    # Castagnoli, hardware accelerated
_FLAG_TOMBSTONE = 1
# magic, version, algorithm, flags, payload length, namespace hash, key, crc
_HDR = struct.Struct("<4sHHIQ8s32sI")
HEADER_BYTES = _HDR.size  # 64
_CRC_OFF = HEADER_BYTES - 4
_KEY_BYTES = 32
_GIB = 1024**3


def _load_crc32c():
    """crc32c_extend(crc, ptr, n) from the libcrc32c bundled with google-crc32c."""
    candidates = []
    try:
        import google_crc32c

        base = os.path.dirname(google_crc32c.__file__)
        libs = os.path.join(base, "..", "google_crc32c.libs")
        candidates += sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*")))
        candidates += sorted(glob.glob(os.path.join(base, "libcrc32c*.so*")))
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    found = ctypes.util.find_library("crc32c")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
            fn.restype = ctypes.c_uint32
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            if fn(0, b"123456789", 9) == 0xE3069283:  # the standard check value
                return fn
        except Exception:  # noqa: BLE001
            continue
    return None


_crc32c_extend = _load_crc32c()
_WRITE_ALG = _ALG_CRC32C if _crc32c_extend is not None else _ALG_CRC32


def _checksum(alg: int, prefix: bytes, payload: torch.Tensor) -> int | None:
    """CRC over the header prefix, then the payload (1-D contiguous uint8 CPU)."""
    if alg == _ALG_CRC32C:
        if _crc32c_extend is None:
            return None
        crc = _crc32c_extend(0, prefix, len(prefix))
        if payload.numel():
            crc = _crc32c_extend(crc, payload.data_ptr(), payload.numel())
        return crc
    if alg == _ALG_CRC32:
        crc = zlib.crc32(prefix)
        if payload.numel():
            crc = zlib.crc32(memoryview(payload.numpy()), crc)
        return crc
    return None


def _namespace_hash(namespace: str, block_bytes: int) -> bytes:
    return hashlib.sha256(f"kvbm-tier|v{_VERSION}|{block_bytes}|{namespace}".encode()).digest()[:8]


def disk_page_path(directory: str, namespace: str, block_bytes: int, rank: int,
                   world_size: int, key: bytes) -> str:
    """The file DiskStore keeps key's page in (LMCache's naming), without LMCache.

    Files appear only complete (written as ``.tmp`` and renamed) and vanish
    on eviction, so a reader in another process may treat existence as "on
    disk" (the content is still verified when read).
    """
    model = "kvbm_" + _namespace_hash(namespace, block_bytes).hex()
    name = f"{model}@{world_size}@{rank}@{int.from_bytes(key, 'big'):x}@uint8.pt"
    return os.path.join(os.path.abspath(os.path.expanduser(directory)), name)


class _Codec:
    """Encodes/verifies ``header + payload`` pages for one namespace."""

    def __init__(self, namespace: str, block_bytes: int):
        self.ns8 = _namespace_hash(namespace, block_bytes)
        self.model_name = "kvbm_" + self.ns8.hex()
        self.block_bytes = block_bytes
        self.stored_bytes = HEADER_BYTES + block_bytes

    def _header(self, key: bytes, flags: int, plen: int, alg: int, payload: torch.Tensor) -> bytes:
        prefix = _HDR.pack(_MAGIC, _VERSION, alg, flags, plen, self.ns8, key, 0)[:_CRC_OFF]
        crc = _checksum(alg, prefix, payload)
        return prefix + struct.pack("<I", crc)

    def encode_into(self, buf: torch.Tensor, key: bytes, page: torch.Tensor) -> None:
        """buf: 1-D uint8 of stored_bytes. Copies page, then checksums the copy."""
        payload = buf[HEADER_BYTES:]
        copy_bytes(payload, page)
        hdr = self._header(key, 0, self.block_bytes, _WRITE_ALG, payload)
        ctypes.memmove(buf.data_ptr(), hdr, HEADER_BYTES)

    def encode_tombstone(self, buf: torch.Tensor, key: bytes) -> None:
        hdr = self._header(key, _FLAG_TOMBSTONE, 0, _WRITE_ALG, buf[HEADER_BYTES:HEADER_BYTES])
        ctypes.memmove(buf.data_ptr(), hdr, HEADER_BYTES)

    def decode_into(self, buf: torch.Tensor, key: bytes, out: torch.Tensor) -> str:
        """Verifies buf (1-D uint8) against key; copies the payload into out on success."""
        if buf.numel() < HEADER_BYTES:
            return "corrupt"
        hdr = buf[:HEADER_BYTES].numpy().tobytes()
        magic, version, alg, flags, plen, ns8, k, crc = _HDR.unpack(hdr)
        if magic != _MAGIC or version != _VERSION or ns8 != self.ns8 or k != key:
            return "corrupt"
        if flags & ~_FLAG_TOMBSTONE:
            return "corrupt"
        want_len = 0 if flags & _FLAG_TOMBSTONE else self.block_bytes
        if plen != want_len or buf.numel() != HEADER_BYTES + plen:
            return "corrupt"
        payload = buf[HEADER_BYTES:]
        got = _checksum(alg, hdr[:_CRC_OFF], payload)
        if got is None:
            # Written with an algorithm this process cannot compute: can't tell.
            return "corrupt" if alg not in (_ALG_CRC32, _ALG_CRC32C) else "error"
        if got != crc:
            return "corrupt"
        if flags & _FLAG_TOMBSTONE:
            return "miss"
        copy_bytes(out, payload)
        return "ok"


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for 1-D uint8 CPU tensors of equal length.

    A plain single-threaded memmove (GIL released): torch's copy_ fans out
    to its intra-op threads and was 30-100x slower for 2 MiB on a small VM.
    """
    if dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())
    else:
        dst.copy_(src)


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _valid_key(key) -> bool:
    return isinstance(key, (bytes, bytearray)) and len(key) == _KEY_BYTES


def _valid_page(t, block_bytes: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
            and t.device.type == "cpu" and t.numel() == block_bytes)


def _start_loop(name: str):
    loop = asyncio.new_event_loop()

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()
            except Exception:  # noqa: BLE001
                pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return loop, thread


def _stop_loop(loop, thread, wait_s: float) -> bool:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # already closed
        pass
    thread.join(wait_s)
    return not thread.is_alive()


def _lmcache():
    """Imports LMCache lazily (it is slow to import and not needed without tiers)."""
    from lmcache.utils import CacheEngineKey, parse_cache_key
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    return CacheEngineKey, parse_cache_key, LMCacheEngineConfig, MemoryFormat, LMCacheMetadata


class TierStore:
    """What the connector needs from a lower tier."""

    name: str = ""

    def put(self, key: bytes, page: torch.Tensor) -> bool:
        """Copies page (1-D uint8 CPU, block_bytes) before returning; False if refused/failed."""
        raise NotImplementedError

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        """Fills out -> "ok" | "miss" | "corrupt" (entry removed) | "error"."""
        raise NotImplementedError

    def contains(self, key: bytes) -> bool:
        raise NotImplementedError

    def remove(self, key: bytes) -> None:
        raise NotImplementedError

    def stored_keys(self) -> list[bytes]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Base(TierStore):
    def __init__(self, block_bytes: int, namespace: str, rank: int, world_size: int):
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        (self._CacheEngineKey, self._parse_cache_key, self._Config, MemoryFormat,
         LMCacheMetadata) = _lmcache()
        self._fmt = MemoryFormat.KV_2LTD  # any non-binary format; arena-backed
        self._codec = _Codec(namespace, block_bytes)
        self.block_bytes = block_bytes
        self._rank, self._world_size = rank, world_size
        self._model = self._codec.model_name
        n = self._codec.stored_bytes
        self._shape = torch.Size([1, 1, 1, n])          # 4-D: close() needs it
        self._tomb_shape = torch.Size([1, 1, 1, HEADER_BYTES])
        self._phys = (n + 4095) // 4096 * 4096          # allocator/disk accounting unit
        self._md = LMCacheMetadata(
            model_name=self._model, world_size=world_size, local_world_size=world_size,
            worker_id=rank, local_worker_id=rank, kv_dtype=torch.uint8,
            kv_shape=(1, 1, 1, 1, n), chunk_size=1)

    def _ckey(self, key: bytes):
        return self._CacheEngineKey(self._model, self._world_size, self._rank,
                                    int.from_bytes(key, "big"), torch.uint8)


# ---------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------

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
                with open(tmp, "wb") as f:
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
            return True

        def load_bytes_from_disk(self, key, path, dtype, shape, fmt):
            mo = self.local_cpu_backend.allocate(shape, dtype, fmt, busy_loop=False)
            if mo is None:
                raise _NoStaging()
            try:
                view = memoryview(mo.byte_array).cast("B")
                with open(path, "rb", buffering=0) as f:  # FileNotFoundError propagates
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


class DiskStore(_Base):
    """Pages as files in ``directory`` via LMCache's LocalDiskBackend (LRU by bytes).

    Each page costs ``block_bytes + 64`` rounded up to 4 KiB of the capacity.
    A new instance on the same directory adopts the pages left there by an
    earlier one (same namespace, rank and world size), newest first up to the
    capacity; older surplus files are deleted.
    """

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, namespace: str,
                 rank: int, world_size: int, *, io_timeout_s: float = 30.0, max_inflight: int = 8):
        super().__init__(block_bytes, namespace, rank, world_size)
        if capacity_bytes < self._phys:
            raise disk_tier_too_small(capacity_bytes, self._phys)
        self.directory = _prepare_dir(directory)
        self.capacity_bytes = int(capacity_bytes)
        self._io_timeout_s = io_timeout_s
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        cfg = self._Config.from_defaults(
            chunk_size=1, local_cpu=False,
            # staging only; slack in case the allocator aligns more coarsely
            max_local_cpu_size=((max_inflight + 2) * self._phys + 8 * 1024**2) / _GIB,
            local_disk=self.directory, max_local_disk_size=self.capacity_bytes / _GIB)
        self._slots = threading.BoundedSemaphore(max_inflight)  # staging users (put + get)
        self._loop, self._thread = _start_loop("kvbm-disk-io")
        self._staging = LocalCPUBackend(cfg, self._md)
        self._disk = _disk_backend_class()(cfg, self._loop, self._staging, dst_device="cpu",
                                           metadata=self._md)
        self._disk.max_cache_size = self.capacity_bytes  # exact, not via float GiB
        self._closed = False
        probe = self._staging.allocate(self._shape, torch.uint8, self._fmt, busy_loop=False)
        if probe is None:
            self.close()
            raise RuntimeError("disk tier: cannot allocate LMCache staging memory")
        self._phys = probe.get_physical_size()  # what LMCache charges per page
        probe.ref_count_down()
        self._writes_failing = False
        self.adopted = self._adopt_existing()

    # -- restart ----------------------------------------------------------
    def _adopt_existing(self) -> int:
        prefix = f"{self._model}@{self._world_size}@{self._rank}@"
        found = []
        for fn in os.listdir(self.directory):
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
                key = h.to_bytes(_KEY_BYTES, "big")
                if self._disk._key_to_path(self._ckey(key)) != path:
                    continue
                st = os.stat(path)
            except Exception:  # noqa: BLE001 - not a name we wrote
                continue
            if st.st_size != self._codec.stored_bytes:
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
        if self._closed or not _valid_key(key) or not _valid_page(page, self.block_bytes):
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
                self._codec.encode_into(_flat_u8(mo.tensor), key, page)
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
        if self._closed or not _valid_key(key) or not _valid_page(out, self.block_bytes):
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
            status = self._codec.decode_into(_flat_u8(mo.tensor), key, out)
        finally:
            mo.ref_count_down()
        if status == "corrupt":
            logger.warning("disk tier: corrupt page removed: %s", self._disk._key_to_path(ck))
            self._disk.remove(ck)
        elif status == "ok":
            try:  # persist recency for the LRU order after a restart
                os.utime(self._disk._key_to_path(ck))
            except OSError:
                pass
        return status

    def contains(self, key: bytes) -> bool:
        try:
            return (not self._closed and _valid_key(key)
                    and self._disk.contains(self._ckey(bytes(key))))
        except Exception:  # noqa: BLE001
            return False

    def remove(self, key: bytes) -> None:
        try:
            if _valid_key(key):
                self._disk.remove(self._ckey(bytes(key)))
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: remove failed: %s", e)

    def stored_keys(self) -> list[bytes]:
        with self._disk.disk_lock:
            hashes = [k.chunk_hash for k in self._disk.dict]
        return [int(h).to_bytes(_KEY_BYTES, "big") for h in hashes]

    def used_bytes(self) -> int:
        return int(self._disk.current_cache_size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._disk.close()  # waits for queued writes
        except Exception as e:  # noqa: BLE001
            logger.warning("disk tier: close: %s", e)
        if _stop_loop(self._loop, self._thread, 5.0):
            try:
                self._staging.close()
            except Exception:  # noqa: BLE001
                pass


# ---------------------------------------------------------------------------
# Remote
# ---------------------------------------------------------------------------

_URL = re.compile(r"^lm://([^:/]+):([0-9]+)$")


class _RemoteConn:
    """One connection generation: its own event loop, staging memory and socket.

    After any error it is thrown away whole, so a desynchronised stream,
    coroutines stuck on it and staging memory they leaked go with it.
    """

    def __init__(self, host: str, port: int, cfg, md, timeout_s: float, connect_s: float):
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        # LMCache connects without a timeout; probe first so an unreachable
        # host costs at most connect_s.
        socket.create_connection((host, port), timeout=max(connect_s, 0.05)).close()
        self.sock = None
        self.loop, self.thread = _start_loop("kvbm-remote-io")
        try:
            self.staging = LocalCPUBackend(cfg, md)
            self.rb = RemoteBackend(cfg, md, self.loop, self.staging, dst_device="cpu")
            if self.rb.connection is None:
                raise ConnectionError(f"could not connect to {host}:{port}")
            self.conn = self.rb.connection
            inner = getattr(self.conn, "_connector", self.conn)
            self.sock = inner.client_socket
            self.sock.settimeout(timeout_s)  # bounds the blocking recv/send on the loop
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise

    def run(self, coro, timeout: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(max(timeout, 0.0))
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"remote call took longer than {timeout:.2f}s") from None

    def at_eof(self) -> bool:
        """True if the stream is unusable: with no call running, anything
        readable is either the server's hang-up or bytes nobody asked for."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv/send
            except OSError:
                pass
        if _stop_loop(self.loop, self.thread, 0.2):
            if self.sock is not None:
                try:
                    self.sock.close()
                except OSError:
                    pass
        # A loop thread still stuck ends within the socket timeout; its
        # staging memory is released with it by the garbage collector.


class RemoteStore(_Base):
    """Pages on an LMCache server (``lm://host:port``) via LMCache's RemoteBackend.

    ``put`` returns True once the server has the page (a PUT followed by an
    EXIST on the same ordered stream). Every call is bounded by
    ``timeout_s``. On an error or timeout the connection is dropped and
    calls fail fast ("error"/False) until the next reconnect attempt, at most
    once per ``retry_interval_s``. One call at a time uses the connection
    (the lm:// stream has no request ids).
    The server never evicts; ``remove`` writes a tombstone (a header-only
    page that reads back as "miss").
    """

    name = "remote"

    def __init__(self, url: str, block_bytes: int, namespace: str, rank: int, world_size: int,
                 timeout_s: float = 2.0, *, retry_interval_s: float = 2.0):
        super().__init__(block_bytes, namespace, rank, world_size)
        m = _URL.match(url or "")
        if not m or not 0 < int(m.group(2)) < 65536:
            raise KVBMConfigError(
                f"remote_url: {url!r} is not an LMCache server URL; write it as "
                f"\"lm://HOST:PORT\" (start one with: python -m lmcache.v1.server HOST PORT)")
        if not timeout_s > 0:
            raise KVBMConfigError(f"remote_timeout_s: must be positive, got {timeout_s!r}")
        self.url = url
        self._host, self._port = m.group(1), int(m.group(2))
        self._timeout_s = float(timeout_s)
        self._retry_s = float(retry_interval_s)
        self._cfg = self._Config.from_defaults(
            chunk_size=1, local_cpu=False, max_local_cpu_size=4 * self._phys / _GIB,
            remote_url=url, remote_serde="naive", blocking_timeout_secs=max(1, int(timeout_s + 1)))
        self._lock = threading.Lock()      # one call on the stream at a time
        self._conn: _RemoteConn | None = None
        self._next_try = 0.0
        self._state = "new"
        self._closed = False
        self._removed: set[bytes] = set()  # tombstoned by us: contains() -> False
        self._suspect: set[bytes] = set()  # puts cut off mid-stream: overwrite on reconnect
        with self._lock:
            self._connection(time.monotonic() + self._timeout_s)

    # -- connection state ----------------------------------------------------
    def _set_state(self, state: str, why=None) -> None:
        if state == self._state:
            return
        prev, self._state = self._state, state
        if state == "down":
            logger.warning("remote tier %s unavailable (%s); calls fail fast, reconnecting at "
                           "most every %.1fs", self.url, why, self._retry_s)
        elif prev == "down":
            logger.warning("remote tier %s reachable again", self.url)

    def _connection(self, deadline: float) -> _RemoteConn | None:
        if self._conn is not None or self._closed:
            return self._conn
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self._retry_s
        try:
            conn = _RemoteConn(self._host, self._port, self._cfg, self._md, self._timeout_s,
                               deadline - now)
        except Exception as e:  # noqa: BLE001
            self._set_state("down", e)
            return None
        self._conn = conn
        try:
            for key in list(self._suspect)[:256]:  # may hold a half-received page
                self._send(conn, key, None, deadline)
                self._suspect.discard(key)
        except Exception as e:  # noqa: BLE001
            self._drop(conn, e)
            return None
        self._set_state("up")
        return conn

    def _drop(self, conn: _RemoteConn, why) -> None:
        if self._conn is conn:
            self._conn = None
        self._next_try = time.monotonic() + self._retry_s
        self._set_state("down", why)
        conn.close()

    def _call(self, fn, fail):
        """Runs fn(conn, deadline) under the stream lock; any failure -> fail."""
        if self._closed:
            return fail
        deadline = time.monotonic() + self._timeout_s
        if not self._lock.acquire(timeout=self._timeout_s):
            return fail  # another call holds the stream for its whole timeout
        try:
            conn = self._connection(deadline)
            if conn is None:
                return fail
            try:
                return fn(conn, deadline)
            except Exception as e:  # noqa: BLE001 - timeout, reset, desync, ...
                self._drop(conn, e)
                return fail
        finally:
            self._lock.release()

    def _send(self, conn: _RemoteConn, key: bytes, page, deadline: float) -> None:
        """Puts page (None: a tombstone) and waits until it is on the wire."""
        shape = self._tomb_shape if page is None else self._shape
        mo = conn.staging.allocate(shape, torch.uint8, self._fmt, busy_loop=False)
        if mo is None:
            raise RuntimeError("remote staging memory exhausted")
        try:
            buf = _flat_u8(mo.tensor)
            if page is None:
                self._codec.encode_tombstone(buf, key)
            else:
                self._codec.encode_into(buf, key, page)
            fut = conn.rb.submit_put_task(self._ckey(key), mo)
        finally:
            mo.ref_count_down()
        try:
            fut.result(max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            fut.cancel()
            self._suspect.add(key)
            raise TimeoutError("remote put timed out") from None

    # -- API -------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        if not _valid_key(key) or not _valid_page(page, self.block_bytes):
            return False
        key = bytes(key)

        def op(conn, deadline):
            self._send(conn, key, page, deadline)
            # lm:// PUT has no reply; the server handles a connection's
            # commands in order, so a following EXIST confirms it was stored.
            ck = self._ckey(key)
            if not conn.run(conn.conn.exists(ck), deadline - time.monotonic()):
                return False
            self._removed.discard(key)
            return True
        try:
            return self._call(op, False)
        except Exception as e:  # noqa: BLE001
            logger.warning("remote tier: put failed: %s", e)
            return False

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        if not _valid_key(key) or not _valid_page(out, self.block_bytes):
            return "error"
        key = bytes(key)

        def op(conn, deadline):
            try:
                mo = conn.run(conn.conn.get(self._ckey(key)), deadline - time.monotonic())
            except TimeoutError:
                raise
            except Exception:
                self._suspect.add(key)  # an entry LMCache cannot even read back
                raise
            if mo is None:
                if conn.at_eof():
                    # The server announced the page, then hung up: LMCache's
                    # server does that for an entry it stored from a PUT cut
                    # off mid-stream. Overwrite it once reconnected.
                    self._suspect.add(key)
                    raise ConnectionError("server closed the connection during a GET")
                return "miss"
            try:
                status = self._codec.decode_into(_flat_u8(mo.tensor), key, out)
            finally:
                mo.ref_count_down()
            if status == "corrupt":
                logger.warning("remote tier: corrupt page for key %s overwritten", key.hex()[:16])
                self._forget(key)
                self._send(conn, key, None, deadline)
            return status
        try:
            return self._call(op, "error")
        except Exception as e:  # noqa: BLE001
            logger.warning("remote tier: get failed: %s", e)
            return "error"

    def contains(self, key: bytes) -> bool:
        if not _valid_key(key) or bytes(key) in self._removed:
            return False
        ck = self._ckey(bytes(key))
        try:
            return bool(self._call(
                lambda conn, deadline: conn.run(conn.conn.exists(ck), deadline - time.monotonic()),
                False))
        except Exception:  # noqa: BLE001
            return False

    def remove(self, key: bytes) -> None:
        if not _valid_key(key):
            return
        key = bytes(key)
        self._forget(key)
        try:
            self._call(lambda conn, deadline: self._send(conn, key, None, deadline), None)
        except Exception:  # noqa: BLE001
            pass

    def _forget(self, key: bytes) -> None:
        if len(self._removed) >= 65536:
            self._removed.clear()  # only an optimisation: the tombstone stays
        self._removed.add(key)

    def stored_keys(self) -> list[bytes]:
        return []

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def close(self) -> None:
        if self._closed:
            return
        got = self._lock.acquire(timeout=self._timeout_s)
        try:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        finally:
            if got:
                self._lock.release()


def disk_page_path(directory: str, namespace: str, block_bytes: int, rank: int,
                   world_size: int, key: bytes) -> str:
    """Where ``DiskStore`` keeps ``key``'s page: the scheduler's disk index is
    the directory itself (see tier_policy.DiskView)."""
    CacheEngineKey = _lmcache()[0]
    model = _Codec(namespace, block_bytes).model_name
    ckey = CacheEngineKey(model, world_size, rank, int.from_bytes(key, "big"), torch.uint8)
    return os.path.join(os.path.abspath(directory),
                        ckey.to_string().replace("/", "-") + ".pt")
