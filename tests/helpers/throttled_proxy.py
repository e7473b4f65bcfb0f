"""A TCP proxy on 127.0.0.1 that slows what a server sends back: a slow tier, for real.

The client's bytes go through as they come; the server's replies are paced
at ``rate`` bytes per second (changeable while it runs; None: unpaced), so a
remote tier behind it answers lookups at once but reads pages slowly, like
a congested link. Used by the load/recompute split's test and benchmark.
"""

from __future__ import annotations

import socket
import threading
import time

from vllm_kvbm.tiers.lm.view import quick_ack

_CHUNK = 64 * 1024


class ThrottledProxy:
    """``before_send(data)``, if given, runs on a connection's thread before
    each chunk the client sends goes on to the server (a fault at a given
    request: helpers/read_fault_relay.py)."""

    def __init__(
        self, target_port: int, rate: float | None, target_host: str = "127.0.0.1", before_send=None
    ):
        self.target = (target_host, target_port)
        self.rate = rate
        self._before_send = before_send
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="throttled-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):  # adds no delay of its own to small messages
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            for src, dst, paced in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, paced), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while True:
                quick_ack(src)
                data = src.recv(_CHUNK)
                if not data:
                    break
                if not paced and self._before_send is not None:
                    self._before_send(data)
                dst.sendall(data)
                rate = self.rate
                if paced and rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks = []
