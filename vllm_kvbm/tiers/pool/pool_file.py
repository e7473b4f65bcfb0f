"""A pool file on disk and in memory: created, found again, replaced, mapped and locked.

Used by the worker's PoolStore (store.py) and by the kvbm-pool process
(tools/pool.py); the scheduler's view maps the slot table read-only
(``map_table``). Every process that maps a file read-write holds a shared
``flock`` on it while it does, so a file is replaced only when nobody uses
it. Creating or replacing a file, and every write into it, happens under an
exclusive ``flock`` on ``<name>.lock`` beside it (``PoolFile.write_lock``):
several engines of one model on one machine (replicas, data-parallel ranks)
write into one pool file in turn, and any of them reads it without a lock
(the slot table's seqlock, layout.py).

A crash leaves nothing that breaks the next start: a file whose superblock
does not match this engine (another page size, KV layout or format) is
retired (its superblock says so, for views that still map it) and replaced
once nobody maps it; a matching one is reused, its pages found again at once;
a half-created file (``<name>.tmp-<pid>``) is deleted. Files are created
0600 and never opened through a symlink; their space is reserved when they
are created (a full memory filesystem would otherwise kill the writer with
SIGBUS at its first write), after checking the filesystem's free space.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import logging
import mmap
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import RETIRED, Geometry, Superblock

logger = logging.getLogger(__name__)

# How long a writer waits for another process's write (one page) to end.
LOCK_WAIT_S = 5.0
# Filesystems that keep a file's pages in memory only. On any other the
# kernel writes a pool's pages back to a disk, and a copy into the mapping
# (on vLLM's worker thread) can wait on that disk.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_warned_dirs: set[str] = set()


@dataclass(frozen=True)
class PoolSpec:
    """What one worker's pool file must be: its name, what it is derived
    from, what its pages verify against, and the geometry to create it with
    (an existing file keeps its own number of slots)."""

    directory: str
    name: str
    name_digest: bytes
    scope_digest: bytes
    geometry: Geometry

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @classmethod
    def for_worker(
        cls,
        directory: str,
        namespace: str,
        page_bytes: int,
        rank: int,
        world_size: int,
        layout_fp: str,
        capacity_bytes: int,
    ) -> "PoolSpec":
        from vllm_kvbm.tiers.page_format import HEADER_BYTES

        geometry = Geometry.for_capacity(capacity_bytes, HEADER_BYTES + page_bytes)
        if geometry is None:
            raise pool_too_small(capacity_bytes, HEADER_BYTES + page_bytes)
        digest = layout.name_digest(namespace, page_bytes, rank, world_size)
        return cls(
            os.path.abspath(directory),
            layout.file_name(digest, rank, world_size),
            digest,
            layout.scope_digest(namespace, page_bytes, rank, world_size, layout_fp),
            geometry,
        )


def pool_too_small(capacity_bytes: int, stored_bytes: int) -> KVBMConfigError:
    need = layout.SUPERBLOCK_BYTES + layout.ALIGN + -(-stored_bytes // layout.ALIGN) * layout.ALIGN
    return KVBMConfigError(
        f"pool_cache_size: {capacity_bytes} bytes cannot hold one KV page of this model "
        f"({stored_bytes} bytes with its header, and the pool's table); set pool_cache_size "
        f"to at least {need} bytes"
    )


class PoolFile:
    """One pool file mapped read-write, held with a shared lock until ``close``.

    ``view``: a memoryview of the whole mapping; ``addr``: its address (what a
    NIXL agent registers to serve it to peers)."""

    def __init__(self, path: str, fd: int, lock_fd: int, superblock: Superblock):
        self.path, self._fd, self._lock_fd = path, fd, lock_fd
        self.superblock = superblock
        self.geometry = superblock.geometry
        self.size = self.geometry.file_bytes
        self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(AttributeError, OSError):
            self._map.madvise(mmap.MADV_DONTDUMP)  # pages of KV in a core dump: no
        self._cbuf = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._cbuf)
        self.view = memoryview(self._map)
        self._thread_lock = threading.Lock()  # flock does not exclude threads of one process
        self.closed = False
        # the rank-0 control endpoint peers read this file's pages at (the
        # worker's own server or kvbm-pool's; None: not served), for the
        # peer directory's entries (tiers/peer/directory.py)
        self.served_at: str | None = None
        # an attached worker's watch on kvbm-pool (tiers/pool/watch.py), ended at close
        self.watch = None

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def used_slots(self) -> int:
        return layout.read_used(self.view)

    def add_used(self, delta: int) -> None:
        """Under write_lock: the superblock's count of slots holding a page."""
        layout.write_u64(self.view, layout.USED_OFF, max(0, self.used_slots + delta))

    @contextlib.contextmanager
    def write_lock(self, timeout_s: float = LOCK_WAIT_S):
        """Exclusive against every writer of this file, in any process;
        raises TimeoutError after ``timeout_s``."""
        if not self._thread_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"pool file {self.path}: write lock busy in this process")
        try:
            _flock(self._lock_fd, fcntl.LOCK_EX, timeout_s, self.path)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.close()
        self.view.release()
        del self._cbuf
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view of it: freed at exit
            logger.debug("pool file %s: mapping still referenced at close", self.path)
        for fd in (self._fd, self._lock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)  # releases the shared lock: the file may be replaced now


def _flock(fd: int, how: int, timeout_s: float, path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"pool file {path}: lock held by another process for {timeout_s:g} s"
                ) from None
            time.sleep(0.001)


def _open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def open_pool(spec: PoolSpec, create: bool = True) -> PoolFile:
    """The pool file ``spec`` names, mapped and held: the existing one if it
    matches (its pages found again), else a new one (``create``; without it,
    KVBMConfigError). Raises KVBMConfigError naming the key and the fix when
    the directory cannot hold the file, or another engine whose pages do not
    match uses a file of this name."""
    lock_fd = _open_nofollow(spec.path + ".lock", os.O_RDWR | os.O_CREAT)
    _warn_unless_in_memory(spec.directory)
    try:
        _flock(lock_fd, fcntl.LOCK_EX, LOCK_WAIT_S, spec.path)
        try:
            found = _existing(spec, lock_fd)
            if found is not None:
                return found
            if not create:
                raise KVBMConfigError(f"pool file {spec.path} does not exist")
            return _create(spec, lock_fd)
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
    except BaseException:
        os.close(lock_fd)
        raise


def _existing(spec: PoolSpec, lock_fd: int) -> PoolFile | None:
    """The matching file at spec.path, held; None once a stale one is gone."""
    try:
        fd = _open_nofollow(spec.path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        os.unlink(spec.path)  # a symlink planted under our name: never followed
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise KVBMConfigError(
                f"pool_dir: {spec.path} is not a pool file of this user (uid {os.geteuid()}); "
                f"remove it, or set pool_dir to a directory of this user's"
            )
        sb = Superblock.unpack(os.pread(fd, layout.SUPERBLOCK_BYTES, 0), st.st_size)
        if (
            sb is not None
            and sb.state == layout.LIVE
            and sb.name_digest == spec.name_digest
            and sb.scope_digest == spec.scope_digest
            and sb.geometry.stored_bytes == spec.geometry.stored_bytes
            and not stat.S_IMODE(st.st_mode) & 0o077
        ):
            fcntl.flock(fd, fcntl.LOCK_SH)
            pool = PoolFile(spec.path, fd, lock_fd, sb)
            if sb.geometry.nslots != spec.geometry.nslots:
                logger.info(
                    "KVBM: pool file %s keeps its %d slots (created by another engine "
                    "or an earlier pool_cache_size; this one asked for %d)",
                    spec.path,
                    sb.geometry.nslots,
                    spec.geometry.nslots,
                )
            return pool
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KVBMConfigError(
                f"pool_dir: {spec.path} is in use by another engine or kvbm-pool whose pages do "
                f"not match this engine's (another KV cache layout, page size or pool format); "
                f"give this engine its own pool_dir"
            ) from None
        if sb is not None:
            os.pwrite(fd, layout._U32.pack(RETIRED), layout.STATE_OFF)  # views drop it
        os.unlink(spec.path)
        logger.info(
            "KVBM: replaced stale pool file %s (%s)",
            spec.path,
            "not a pool file" if sb is None else "its pages do not match this engine",
        )
        os.close(fd)
        return None
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _create(spec: PoolSpec, lock_fd: int) -> PoolFile:
    for leftover in glob.glob(glob.escape(spec.path) + ".tmp-*"):  # a crash's, under our lock
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    g = spec.geometry
    check_space(spec.directory, g.file_bytes)
    tmp = f"{spec.path}.tmp-{os.getpid()}"
    fd = _open_nofollow(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        try:
            os.posix_fallocate(fd, 0, g.file_bytes)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG):
                raise
            raise _no_room(spec.directory, g.file_bytes) from None
        sb = Superblock(
            spec.name_digest, spec.scope_digest, g, uuid.uuid4().bytes, os.getpid(), time.time_ns()
        )
        os.pwrite(fd, sb.pack(), 0)
        os.rename(tmp, spec.path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        # said by the caller, in its own startup line
        logger.debug(
            "KVBM: created pool file %s: %d slots of %d bytes (%.2f GiB)",
            spec.path,
            g.nslots,
            g.stride,
            g.file_bytes / 1024**3,
        )
        return PoolFile(spec.path, fd, lock_fd, sb)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` lies on, from /proc/self/mountinfo
    (or ``mountinfo``'s text): the last mount of the longest mount point
    above it. None where it cannot be told."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return None
    real, best, found = os.path.realpath(path), -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        # mountinfo writes a space in a mount point as \040 (octal escapes)
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        under = real == mount or real.startswith(mount.rstrip("/") + "/")
        if under and len(mount) >= best:
            best, found = len(mount), fields[fields.index("-", 6) + 1]
    return found


def _warn_unless_in_memory(directory: str) -> None:
    """Says once per directory when pool_dir is not a memory filesystem."""
    fstype = filesystem_type(directory)
    if fstype is None or fstype in MEMORY_FILESYSTEMS or directory in _warned_dirs:
        return
    _warned_dirs.add(directory)
    logger.warning(
        "KVBM: pool tier: pool_dir %s is on a %s filesystem, not in memory: the kernel "
        "writes the pool's pages back to its disk and a copy into the pool can wait on "
        "that disk; set pool_dir to a memory filesystem (tmpfs, such as /dev/shm)",
        directory,
        fstype,
    )


def check_space(directory: str, need: int) -> None:
    """Refuses, naming the key and the fix, a file the filesystem cannot hold."""
    st = os.statvfs(directory)
    if need > st.f_bavail * st.f_frsize:
        raise _no_room(directory, need)


def _no_room(directory: str, need: int) -> KVBMConfigError:
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return KVBMConfigError(
        f"pool_cache_size: a pool file of {need} bytes ({need / 1024**3:.2f} GiB) does not fit "
        f"in {directory} ({free} bytes free of {total}); containers get a 64 MiB /dev/shm by "
        f"default: give the container more (docker run --shm-size, compose shm_size, a "
        f"Kubernetes emptyDir with medium: Memory and a sizeLimit), set pool_dir to a larger "
        f"memory filesystem, or set a smaller pool_cache_size"
    )


@dataclass
class MappedTable:
    """A pool file's superblock and slot table mapped read-only (the
    scheduler's view): ``buf`` holds the table at the geometry's offsets."""

    buf: mmap.mmap
    superblock: Superblock
    inode: tuple[int, int]

    @property
    def retired(self) -> bool:
        return layout.read_state(self.buf) == RETIRED

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.buf.close()


def map_table(path: str, name_digest: bytes) -> MappedTable | None:
    """The live pool file at ``path`` for ``name_digest``, its table mapped
    read-only; None where there is none (yet) or it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        sb = Superblock.unpack(os.pread(fd, layout.SUPERBLOCK_BYTES, 0), st.st_size)
        if sb is None or sb.name_digest != name_digest or sb.state != layout.LIVE:
            return None
        buf = mmap.mmap(fd, sb.geometry.data_off, mmap.MAP_SHARED, mmap.PROT_READ)
        return MappedTable(buf, sb, (st.st_dev, st.st_ino))
    except OSError:
        return None
    finally:
        os.close(fd)
