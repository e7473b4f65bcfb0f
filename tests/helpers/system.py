"""Real faults of the machine a test can produce: small or read-only
filesystems, a frozen ext4, a server whose every thread is stopped."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest


def mount_tmpfs(mnt, opts: str) -> None:
    """A real small or read-only filesystem for fault tests (root ignores
    permission bits, not a read-only mount); skips where mounting is refused."""
    os.makedirs(mnt, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); fault not produced")


def umount(mnt) -> None:
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def stop_every_thread(proc: subprocess.Popen, what: str, timeout: float = 5.0) -> None:
    """SIGSTOP a server (a frozen-server fault), and wait until every one of
    its threads has stopped."""
    from vllm_kvbm.tools.server import freeze_process

    freeze_process(proc, what, timeout)


class Ext4:
    """A real ext4 filesystem (a loop-mounted image) a test can freeze:
    ``fsfreeze`` blocks every write and metadata update on it (a read's
    atime/utime touch included) until thawed, as a filesystem snapshot or
    a hung device does."""

    def __init__(self, mnt: Path):
        self.path = mnt
        self.frozen = False

    def freeze(self) -> None:
        subprocess.run(["fsfreeze", "-f", str(self.path)], check=True, timeout=20)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.path)], check=True, timeout=20)
            self.frozen = False


@contextmanager
def shm_dir(prefix: str = "kvbm-test-"):
    """A directory on /dev/shm (the real memory filesystem), removed after."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
