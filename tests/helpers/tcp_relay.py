"""A TCP relay in front of a real server, for faults on one connection only.

Each accepted connection is relayed by a process of its own, so one
connection's path can be frozen (SIGSTOP: its bytes stop flowing both ways,
as on a stalled network path) while the client's other connections to the
same server keep working. Freezing the relay's main process stalls every
connection made from then on (the kernel still accepts them).

Run as a script (``python tcp_relay.py TARGET_PORT``) it prints its port, then
``PID CLIENT_PORT`` for each connection it accepts.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time


def _relay(client: socket.socket, target_port: int) -> None:
    upstream = socket.create_connection(("127.0.0.1", target_port))
    peer = {client: upstream, upstream: client}
    while True:
        readable, _, _ = select.select(list(peer), [], [])
        for sock in readable:
            data = sock.recv(1 << 16)
            if not data:
                return
            peer[sock].sendall(data)


def _main(target_port: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    print(server.getsockname()[1], flush=True)
    while True:
        client, (_, client_port) = server.accept()
        pid = os.fork()
        if pid == 0:
            server.close()
            try:
                _relay(client, target_port)
            finally:
                os._exit(0)
        client.close()
        print(pid, client_port, flush=True)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in "tT":
                return
        time.sleep(0.005)
    raise RuntimeError(f"relay process {pid} did not stop")


class Relay:
    """``python tcp_relay.py`` in front of 127.0.0.1:``target_port``; always killed."""

    def __init__(self, target_port: int, scheme: str = "lm"):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(target_port)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.port = int(self.proc.stdout.readline())
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self._by_client_port: dict[int, int] = {}
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            pid, client_port = map(int, line.split())
            with self._seen:
                self._by_client_port[client_port] = pid
                self._seen.notify_all()

    def pid_of(self, sock: socket.socket) -> int:
        """The process relaying the connection of ``sock`` (the client's socket)."""
        client_port = sock.getsockname()[1]
        with self._seen:
            if not self._seen.wait_for(lambda: client_port in self._by_client_port, 5.0):
                raise RuntimeError(f"no relayed connection from port {client_port}")
            return self._by_client_port[client_port]

    def freeze(self, sock: socket.socket) -> None:
        """Stalls the path of ``sock``'s connection."""
        pid = self.pid_of(sock)
        os.kill(pid, signal.SIGSTOP)
        _wait_stopped(pid)

    def freeze_new_connections(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        _wait_stopped(self.proc.pid)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the relay and every connection's process
        except ProcessLookupError:
            pass
        self.proc.wait(10)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
