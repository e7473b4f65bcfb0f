"""The disk tier's raw file I/O: page files written and read around LMCache, and the directory's checks.

A page is written to ``<name>.tmp`` (0600, O_EXCL|O_NOFOLLOW) and renamed,
1 MiB per call; it is read straight into the caller's slot, each chunk
checked (or decrypted) while still in the CPU's cache, or with O_DIRECT
through an aligned bounce buffer when it is not in the page cache. Used by
DiskStore (store.py) on TierIO's threads; every call may block for as long
as the filesystem takes, and the caller catches what it raises.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import tempfile
import threading
import time

import torch

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.tiers.page_format import HEADER_BYTES


class _ShortFile(Exception):
    pass


# A page is written this much per call: a write of a whole aligned 2 MiB
# range into an empty file can make the kernel back it with one large
# page-cache folio, which may need memory compaction first and then costs
# several times the same bytes in 1 MiB writes (docs/benchmarks.md, disk
# tier); reads do not pay it.
_WRITE_CHUNK = 1024 * 1024


_scratch = threading.local()


def _write_scratch() -> memoryview:
    """This writer thread's buffer for a sealed chunk (the host slot a page
    is written from stays plaintext)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(_WRITE_CHUNK))
    return buf


def _write_page(path: str, codec, key: bytes, payload: torch.Tensor) -> None:
    """Writes ``key``'s page (header + payload) to ``path`` atomically:
    ``<path>.tmp``, then a rename.

    Owner-only, never through a symlink someone planted: the directory may
    be shared (see DiskStore's directory lock). Written from the caller's
    tensor, at most _WRITE_CHUNK per call: without a page secret straight
    from it (no staging copy), each chunk checksummed right before its
    write, while it is in cache; with one each chunk is encrypted into this
    thread's scratch buffer and checksummed there first. The header, which
    holds the checksum, goes last.
    """
    tmp = path + ".tmp"
    try:
        fd = _create(tmp)
        try:
            view = memoryview(payload.numpy())
            signer = codec.signer(key)
            scratch = _write_scratch() if codec.keyed else None
            for off in range(0, len(view), _WRITE_CHUNK):
                stored = signer.seal(view[off : off + _WRITE_CHUNK], scratch)
                _pwrite_all(fd, [stored], HEADER_BYTES + off)
            _pwrite_all(fd, [memoryview(signer.header())], 0)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _create(path: str) -> int:
    """A new owner-only file at ``path``, never through a symlink; a crash's
    leftover there is removed first (a link, not its target)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, 0o600)


def _pwrite_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """One pwritev of ``parts`` at ``offset``, short writes resumed."""
    while parts:
        n = os.pwritev(fd, parts, offset)
        offset += n
        _advance(parts, n)


# Read and checked in pieces of this size: each is checksummed right after it
# is read, while it is still in the CPU's cache. 1 MiB rather than 512 KiB:
# each piece is a GIL round trip, and with reads in flight 4 of them per page
# cost ~10% against 2 (256 KiB: ~15% more).
_READ_CHUNK = 1024 * 1024
_ALIGN = 4096  # O_DIRECT's buffer, offset and length alignment
# A page read is touched (its mtime set: the LRU order a restart adopts) only
# when its time is older than this: a restart's order needs no finer grain,
# and with reads in flight the inode updates cost a warm read 15% here.
_TOUCH_EVERY_S = 60.0


def _read_page(
    path: str, codec, key: bytes, out: "_Out", touch: bool, bounce: "_Bounce | None" = None
) -> str:
    """Reads and checks the page file at ``path`` into ``out`` -> the codec's
    status ("ok", "corrupt", "unauthenticated", "miss" for a tombstone, "error").
    No torch call on the way (see _Out).

    A page in the page cache goes straight into ``out`` (no staging copy), a
    chunk at a time, each checked while still in the CPU's cache. A page none
    of which is cached (cachestat) is read with O_DIRECT into
    ``bounce`` when given (the device DMAs it, no kernel copy; the 96-byte
    header puts the payload off the 4 KiB alignment O_DIRECT needs, so each
    chunk is checked there and then copied into ``out``): several of those
    in flight read faster than buffered reads (benchmarks/bench_disk.py).
    A page that fails leaves ``out`` partly written (the caller never uses a
    slot whose read was not "ok"). A missing file raises FileNotFoundError;
    a symlink, or a file of any other size than ``header + out``, raises
    _ShortFile. ``touch`` sets the file's times to now (the LRU order a
    restart adopts) unless they are less than _TOUCH_EVERY_S old.
    """
    view = out.view
    want = HEADER_BYTES + len(view)
    fd, mtime = _open_page(path, want)
    try:
        header = bytearray(HEADER_BYTES)
        first = view[:_READ_CHUNK]
        status = None
        if bounce is not None and _cached_pages(fd, want) == 0:
            try:
                status = bounce.read(path, codec, key, out)
            except OSError as e:  # an alignment this device refuses: read it buffered
                if e.errno != errno.EINVAL:
                    raise
        if status is None:
            _pread_into(fd, [memoryview(header), first], 0, path)
            status = _check_in_place(fd, codec, key, header, view, path)
        if touch and status == "ok":
            _touch(fd, mtime)
        return status
    finally:
        os.close(fd)


def _open_page(path: str, size: int) -> tuple[int, float]:
    """The page file at ``path`` opened for reading -> (fd, its mtime).
    FileNotFoundError where it is gone; _ShortFile for a symlink (never
    followed) or a file of any other size than ``size``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _ShortFile(f"{path}: a symlink, not a page file") from None
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            raise _ShortFile(f"{path}: {st.st_size} of {size} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_mtime


def _touch(fd: int, mtime: float) -> None:
    """Sets a page file's times to now (the LRU order a restart adopts)
    unless ``mtime`` is less than _TOUCH_EVERY_S old."""
    if time.time() - mtime > _TOUCH_EVERY_S:
        try:
            os.utime(fd)
        except OSError:
            pass


def _check_in_place(
    fd: int, codec, key: bytes, header: bytearray, view: memoryview, path: str
) -> str:
    """The buffered read's rest: its first chunk is in ``view`` already."""
    check = codec.start_verify(bytes(header), key)
    if isinstance(check, str):
        return check
    check.update(view[:_READ_CHUNK])
    for off in range(_READ_CHUNK, len(view), _READ_CHUNK):
        part = view[off : off + _READ_CHUNK]
        _pread_into(fd, [part], HEADER_BYTES + off, path)
        check.update(part)
    return check.finish(view)


class _Out:
    """A host slot as the reader threads write it: a byte memoryview and its
    address, taken from the tensor once, on the calling thread. Tensor calls
    (indexing, .numpy(), .numel()) in the reader threads cost warm reads 4
    in flight 10-20% here (they contend where plain Python does not)."""

    __slots__ = ("view", "addr")

    def __init__(self, out: torch.Tensor):
        self.view = memoryview(out.numpy())
        self.addr = out.data_ptr()


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(os.uname().machine)
_libc = ctypes.CDLL(None, use_errno=True)


def _cached_pages(fd: int, length: int) -> int | None:
    """Pages of the first ``length`` bytes of ``fd`` in the page cache
    (cachestat, Linux 6.5+, no I/O); None where that cannot be asked. A
    probing read (RWF_NOWAIT) would start readahead of a cold page, which
    then competes with its O_DIRECT read."""
    if _SYS_CACHESTAT is None:
        return None
    rng, st = _CacheRange(0, length), _CacheStat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return None
    return st.nr_cache


class _Bounce:
    """One reading thread's 4 KiB-aligned buffer for O_DIRECT page reads."""

    def __init__(self, page_bytes: int):
        self._span = -(-page_bytes // _ALIGN) * _ALIGN
        self._map = mmap.mmap(-1, self._span)  # page-aligned
        self._view = memoryview(self._map)
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.reads = 0  # pages read this way (tests)

    def read(self, path: str, codec, key: bytes, out: "_Out") -> str:
        size = len(out.view)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        try:
            got, want = 0, HEADER_BYTES + size
            while got < want:  # the last 4 KiB block is short: EOF ends it
                n = os.preadv(fd, [self._view[got : self._span]], got)
                if n <= 0:
                    raise _ShortFile(f"{path}: ends at {got}")
                got += n
        finally:
            os.close(fd)
        self.reads += 1
        check = codec.start_verify(bytes(self._view[:HEADER_BYTES]), key)
        if isinstance(check, str):
            return check
        view, src = self._view[HEADER_BYTES:want], self._addr + HEADER_BYTES
        for off in range(0, size, _READ_CHUNK):
            part = view[off : off + _READ_CHUNK]
            if check.opens:  # a sealed page: decrypted from here into the slot
                check.update_into(part, out.view[off : off + _READ_CHUNK])
                continue
            check.update(part)  # then copied while still in cache (GIL released)
            ctypes.memmove(out.addr + off, src + off, len(part))
        return check.finish(out.view)


def _pread_into(fd: int, parts: list[memoryview], offset: int, path: str) -> None:
    """Fills ``parts`` from ``offset`` (short reads resumed); _ShortFile at EOF."""
    while parts:
        n = os.preadv(fd, parts, offset)
        if n <= 0:
            raise _ShortFile(f"{path}: ends at {offset}")
        offset += n
        _advance(parts, n)


def _advance(parts: list[memoryview], n: int) -> None:
    """Drops the first ``n`` bytes of ``parts`` (after a short read or write)."""
    while parts and n >= len(parts[0]):
        n -= len(parts[0])
        parts.pop(0)
    if parts:
        parts[0] = parts[0][n:]


def _allows_o_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs, for
    one, refuses it)."""
    fd = -1
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvbm-direct-probe-", dir=directory)
        os.unlink(probe)
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _prepare_dir(directory: str) -> str:
    d = os.path.abspath(os.path.expanduser(directory))
    fix = "set disk_cache_dir to a writable local directory (or fix its permissions)"
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise KVBMConfigError(
            f"disk_cache_dir: cannot create directory {d!r} ({e.strerror or e}); {fix}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvbm-probe-", dir=d)
        try:
            os.write(fd, b"kvbm")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise KVBMConfigError(
            f"disk_cache_dir: directory {d!r} is not writable ({e.strerror or e}); {fix}"
        ) from None
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
            f"may share one)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
