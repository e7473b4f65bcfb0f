"""What benchmarks/bench_disk.py's paths share: aligned buffers, the page cache
(dropped before a cold pass, filled as writes leave it before a warm one),
timing, and ``Path``, one way of writing and reading the pages."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

MiB = 1024 * 1024
ALIGN = 4096

# ------------------------------------------------------------------ helpers


def aligned_u8(n: int):
    """A page-aligned uint8 tensor of n bytes (anonymous mmap), for O_DIRECT."""
    import torch

    m = mmap.mmap(-1, max(n, 1))
    t = torch.frombuffer(m, dtype=torch.uint8, count=n)
    t._keep = m  # the mapping lives as long as the tensor
    return t


def view_of(t) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (keep t alive)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


class Cache:
    """Drops the page cache before a cold pass: drop_caches or fadvise."""

    def __init__(self):
        self.global_drop = can_drop_caches()
        self.how = (
            "echo 1 > /proc/sys/vm/drop_caches"
            if self.global_drop
            else "posix_fadvise(POSIX_FADV_DONTNEED) per file"
        )

    def drop(self, paths) -> None:
        os.sync()  # dirty pages cannot be dropped
        if self.global_drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(paths) -> None:
    """Puts every file in the page cache as writing it leaves it: its bytes
    read, its cached pages dropped, the same bytes written back 1 MiB per
    call (as the tier writes), then synced (clean, not written again).

    Not by reading the files: a page cache filled by readahead of 2 MiB files
    was 1.4x slower to copy out than the same bytes filled by readahead of
    one big file (read_ahead_kb 8192 here; most likely smaller folios), while
    filled by writes both read at the same speed. The tier's warm pages are
    written ones: its spills leave them there, and a page none of which is
    cached is read with O_DIRECT, which does not fill the cache."""
    seg = 64 * MiB
    for p in paths:
        fd = os.open(p, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for start in range(0, size, seg):
                data = os.pread(fd, min(seg, size - start), start)
                os.fdatasync(fd)
                os.posix_fadvise(fd, start, len(data), os.POSIX_FADV_DONTNEED)
                for off in range(0, len(data), MiB):
                    os.pwrite(fd, data[off : off + MiB], start + off)
        finally:
            os.close(fd)
    os.sync()


def files_in(d: str) -> list[str]:
    return [os.path.join(d, f) for f in os.listdir(d) if not f.startswith(".")]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_all(fd: int, view: memoryview, offset: int = 0) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


# -------------------------------------------------------------------- paths


class Path:
    """One way of writing and reading the pages: write() (None: reads another
    path's files), read() (None: write only), files() (what a cold pass drops)."""

    def __init__(
        self,
        name,
        write=None,
        read=None,
        files=None,
        warm=True,
        close=None,
        prepare=None,
        finish=None,
    ):
        self.name, self.write, self.read, self.files = name, write, read, files
        # Untimed, before each write pass: an empty directory (and a fresh
        # store), so a pass times the writes alone, not deleting the last
        # pass's files or starting a store.
        self.prepare = prepare or (lambda: None)
        self.finish = finish or (lambda: None)  # after a write pass, untimed
        self.warm = warm  # False: O_DIRECT, the page cache is never used
        self.close = close or (lambda: None)
        self.times = {"write": [], "warm": [], "cold": []}
        self.ratios: dict[str, list[float]] = {}  # to raw, pass by adjacent pass
        self.note = ""


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{fs} ({dev} on {mnt})"
    return kind
