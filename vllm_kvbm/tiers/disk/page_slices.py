"""A disk page read a byte range at a time, for hits loaded layer by layer.

A whole-page read (file_io._read_page) lands every layer of the page before
any is used. A hit loaded during the forward pass (worker/layer_reads.py)
wants layer 0 of every page first, then layer 1, ...: each layer's part of
a host row is one range, and the ranges in layer order tile the row, so the
page's bytes still arrive in order and are checked as they go (the checksum
or, on a sealed page, the decryption and tag), exactly as a whole read
checks them. The verdict comes with the last range (``finish``); until then
the bytes in the slot are unchecked and whatever was computed from them is
thrown away if the page turns out bad (the load fails, vLLM recomputes).

Buffered reads only: the O_DIRECT path reads whole 4 KiB-aligned pages. A
page not in the page cache would then be read one range at a time, each
waiting for the device; the reader asks the kernel to read ahead instead
(``ahead``: POSIX_FADV_WILLNEED, asynchronous), the next layers of every
page while the current one is read, so the device queue stays full in the
order the layers are wanted. Every call may block as long as the
filesystem takes; the caller's thread is not vLLM's.
"""

from __future__ import annotations

import os

from vllm_kvbm.tiers.disk.file_io import _open_page, _pread_into, _ShortFile, _touch
from vllm_kvbm.tiers.page_format import HEADER_BYTES


class PageSlices:
    """One page file open for ranged reads into its host slot (a byte
    memoryview of ``page_bytes``), in ascending, gap-free order."""

    def __init__(
        self, fd: int, path: str, codec, key: bytes, view: memoryview, judge, mtime: float = 0.0
    ):
        self._fd, self.path, self._view, self._mtime = fd, path, view, mtime
        self._codec, self._key = codec, key
        self._check = None  # the header's, once read (start)
        self._judge = judge  # status -> status, the store's verdict on a bad page
        self._next = 0

    def ahead(self, off: int, n: int) -> None:
        """Asks the kernel to read payload bytes [off, off + n) ahead (a hint)."""
        try:
            os.posix_fadvise(self._fd, HEADER_BYTES + off, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    def start(self) -> str | None:
        """Reads and checks the header: None to go on, or the status that
        decides the page already (the file then closed)."""
        header = bytearray(HEADER_BYTES)
        try:
            _pread_into(self._fd, [memoryview(header)], 0, self.path)
        except _ShortFile:
            self.close()
            return self._judge("corrupt")
        check = self._codec.start_verify(bytes(header), self._key)
        if isinstance(check, str):
            self.close()
            return self._judge(check)
        self._check = check
        return None

    def read(self, off: int, n: int) -> None:
        """Bytes [off, off + n) of the payload into the slot, checked; raises
        on a short file or an I/O error (the page is then not "ok")."""
        if self._check is None:
            raise ValueError("the page's header is not read yet (start)")
        if off != self._next:
            raise ValueError(f"page ranges out of order: {off} after {self._next}")
        part = self._view[off : off + n]
        _pread_into(self._fd, [part], HEADER_BYTES + off, self.path)
        self._check.update(part)
        self._next = off + n

    def finish(self) -> str:
        """The page's status once every byte was read ("corrupt" if not all
        were); the file closed. A bad page is removed from the store; a good
        one's time set to now, as a whole read does (the LRU order a restart
        adopts), unless it is recent."""
        status = self._check.finish(self._view) if self._check is not None else "corrupt"
        if status == "ok":
            _touch(self._fd, self._mtime)
        self.close()
        return self._judge(status) if status != "ok" else status

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_slices(path: str, codec, key: bytes, view: memoryview, judge) -> PageSlices:
    """The page at ``path`` opened and its size checked (its header read by
    ``start``). Raises as file_io._open_page does (a file gone, a symlink,
    another size)."""
    fd, mtime = _open_page(path, HEADER_BYTES + len(view))
    return PageSlices(fd, path, codec, key, view, judge, mtime)


# Layers of every page asked of the kernel ahead of the one being read (a
# page not in the page cache then arrives while earlier layers are copied).
READ_AHEAD_LAYERS = 2


class PageFiles:
    """A step's disk pages (key, host slot) read a byte range of ``ranges``
    (payload offset, bytes) at a time, page by page within a range, as
    worker/layer_reads.py drives a tier's pages: ``start``, ``read(k)`` per
    range, ``finish``, ``close``; ``statuses`` per page."""

    def __init__(self, store, items, ranges: list[tuple[int, int]]):
        self._store, self._items, self._ranges = store, items, ranges
        self._pages: list[PageSlices] = []
        self.statuses = ["skipped"] * len(items)

    def start(self) -> bool:
        """Every file opened and its header checked: False when a page's
        status decides the step already."""
        first = HEADER_BYTES + sum(n for _, n in self._ranges[:READ_AHEAD_LAYERS])
        for i, (key, out) in enumerate(self._items):
            page = self._store.open_slices(key, out)
            if isinstance(page, str):
                self.statuses[i] = page
                return False
            self._pages.append(page)
            page.ahead(-HEADER_BYTES, first)  # the header with the first layers
        for i, page in enumerate(self._pages):
            status = page.start()
            if status is not None:
                self.statuses[i] = status
                return False
        return True

    def read(self, k: int, stop=lambda: False) -> bool:
        """Range ``k`` of every page (raises on an I/O error or a short file);
        False once ``stop()`` (the step gave up), checked between pages."""
        if k + READ_AHEAD_LAYERS < len(self._ranges):
            for page in self._pages:
                page.ahead(*self._ranges[k + READ_AHEAD_LAYERS])
        off, n = self._ranges[k]
        for page in self._pages:
            if stop():
                return False
            page.read(off, n)
        return True

    def finish(self) -> None:
        self.statuses = [page.finish() for page in self._pages]

    def close(self) -> list[int]:
        """Nothing a read may write once it returned (reads are synchronous)."""
        for page in self._pages:
            page.close()
        return []
