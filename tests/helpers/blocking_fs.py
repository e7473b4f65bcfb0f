"""A FUSE passthrough whose metadata calls can be made to block on demand.

A hung network filesystem blocks ``stat`` (``os.path.exists``) and file
opens for as long as its server does not answer; ``fsfreeze`` blocks only
writes. This mount stands for the former: while ``BlockingMount.blocked()``
is on, every getattr (and so every lookup, stat and open) under the mount
sleeps until it is turned off or ``max_block_s`` passes.

The FUSE server runs in a process of its own (``python blocking_fs.py ROOT
MOUNT FLAG MAX_S``), so the blocked calls are the kernel's, as on a real
mount; the flag is a file outside the mount. Kernel attribute and entry
caching is off, so every stat reaches the server.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def available() -> str | None:
    """None when a blocking mount can be made here, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount") is None:
        return "no fusermount (apt-get install fuse)"
    try:
        import fuse  # noqa: F401  (fusepy)
    except (ImportError, OSError) as err:
        return f"fusepy or libfuse2 missing ({err})"
    return None


class BlockingMount:
    """``path``: the mountpoint, a passthrough to ``root``."""

    def __init__(self, base: Path, max_block_s: float = 30.0):
        self.root = base / "backing"
        self.path = base / "mnt"
        self._flag = base / "block-metadata"
        self.root.mkdir()
        self.path.mkdir()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                str(self.root),
                str(self.path),
                str(self._flag),
                str(max_block_s),
            ],
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"FUSE mount at {self.path} did not come up: "
                    f"{self._proc.stderr.read().decode() if self._proc.stderr else ''}"
                )
            time.sleep(0.02)

    @contextlib.contextmanager
    def blocked(self):
        """Metadata calls under the mount block while inside."""
        self._flag.touch()
        try:
            yield
        finally:
            self._flag.unlink(missing_ok=True)

    @contextlib.contextmanager
    def slow(self, blocked_s: float = 0.3, open_s: float = 0.05):
        """A slow filesystem while inside: metadata calls block for up to
        ``blocked_s``, then all pass for ``open_s``, and again."""
        import threading

        stop = threading.Event()

        def pulse():
            while not stop.is_set():
                self._flag.touch()
                stop.wait(blocked_s)
                self._flag.unlink(missing_ok=True)
                stop.wait(open_s)

        thread = threading.Thread(target=pulse, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(10)
            self._flag.unlink(missing_ok=True)

    def close(self) -> None:
        self._flag.unlink(missing_ok=True)
        subprocess.run(
            ["fusermount", "-u", "-z", str(self.path)],
            timeout=20,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


def _serve(root: str, mount: str, flag: str, max_block_s: float) -> None:
    from fuse import FUSE, FuseOSError, Operations

    class Passthrough(Operations):
        def _real(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def getattr(self, path, fh=None):
            deadline = time.monotonic() + max_block_s
            while os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.02)
            try:
                st = os.lstat(self._real(path))
            except OSError as err:
                raise FuseOSError(err.errno) from None
            return {
                k: getattr(st, k)
                for k in (
                    "st_mode",
                    "st_nlink",
                    "st_uid",
                    "st_gid",
                    "st_size",
                    "st_atime",
                    "st_mtime",
                    "st_ctime",
                )
            }

        def _call(self, fn, *args):
            try:
                return fn(*args)
            except OSError as err:
                raise FuseOSError(err.errno or errno.EIO) from None

        def access(self, path, mode):
            if not os.access(self._real(path), mode):
                raise FuseOSError(errno.EACCES)

        def readdir(self, path, fh):
            return [".", "..", *self._call(os.listdir, self._real(path))]

        def mkdir(self, path, mode):
            return self._call(os.mkdir, self._real(path), mode)

        def rmdir(self, path):
            return self._call(os.rmdir, self._real(path))

        def unlink(self, path):
            return self._call(os.unlink, self._real(path))

        def rename(self, old, new):
            return self._call(os.rename, self._real(old), self._real(new))

        def chmod(self, path, mode):
            return self._call(os.chmod, self._real(path), mode)

        def utimens(self, path, times=None):
            return self._call(os.utime, self._real(path), times)

        def truncate(self, path, length, fh=None):
            return self._call(os.truncate, self._real(path), length)

        def statfs(self, path):
            st = os.statvfs(self._real(path))
            return {
                k: getattr(st, k)
                for k in (
                    "f_bavail",
                    "f_bfree",
                    "f_blocks",
                    "f_bsize",
                    "f_favail",
                    "f_ffree",
                    "f_files",
                    "f_flag",
                    "f_frsize",
                    "f_namemax",
                )
            }

        def open(self, path, flags):
            return self._call(os.open, self._real(path), flags)

        def create(self, path, mode, fi=None):
            return self._call(os.open, self._real(path), os.O_WRONLY | os.O_CREAT, mode)

        def read(self, path, size, offset, fh):
            return self._call(os.pread, fh, size, offset)

        def write(self, path, data, offset, fh):
            return self._call(os.pwrite, fh, data, offset)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            return self._call(os.fsync, fh)

        def release(self, path, fh):
            return self._call(os.close, fh)

    FUSE(
        Passthrough(),
        mount,
        foreground=True,
        nothreads=False,
        entry_timeout=0,
        attr_timeout=0,
        negative_timeout=0,
    )


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
