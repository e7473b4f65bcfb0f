"""A real LMCache server (``python -m lmcache.v1.server``) for the tests, on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from helpers.system import stop_every_thread
from vllm_kvbm.tools.server import free_port

# LMCache's server binds without SO_REUSEADDR, so once it is killed with
# connections open, the port stays taken for a minute (the server side of
# each connection sits in TIME_WAIT, and Linux lets a new server bind over
# those only if both sockets set SO_REUSEADDR). So the fixture runs the very
# module `python -m lmcache.v1.server` runs, through runpy, with that option.
_REUSEADDR_LAUNCHER = """
import runpy, socket
_bind = socket.socket.bind
def bind(self, addr):
    self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return _bind(self, addr)
socket.socket.bind = bind
runpy.run_module("lmcache.v1.server", run_name="__main__", alter_sys=True)
"""


class LMServer:
    """A real LMCache server (lmcache.v1.server's __main__) on 127.0.0.1; always killed."""

    def __init__(self):
        self.port = free_port()
        self.url = f"lm://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _REUSEADDR_LAUNCHER, "127.0.0.1", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"},
        )

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread of the server has stopped."""
        stop_every_thread(self.proc, "lmcache server")

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"lmcache server not listening after {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
