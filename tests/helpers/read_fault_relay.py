"""A TCP relay on 127.0.0.1 in front of a real Redis server that runs a fault
at the moment a page is read.

Lookups (EXISTS) and writes (SET) pass as they come. Once ``arm(fault)`` is
called, the first GET a client sends waits on its connection until
``fault()`` returned (delete the pages, kill the server, stall past the
client's timeout), then goes on to the server: the fault lands exactly between
a hit's lookup and its read, as an eviction or an outage at that moment would.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

_CHUNK = 64 * 1024
# A GET as redis-py sends it (CONFIG GET and the like are longer arrays).
_GET = b"*2\r\n$3\r\nGET\r\n"


class ReadFaultRelay:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._fault: Callable[[], None] | None = None
        self.fired = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="read-fault-relay", daemon=True).start()

    def arm(self, fault: Callable[[], None]) -> None:
        with self._lock:
            self._fault = fault
            self.fired.clear()

    def _take_fault(self, data: bytes) -> Callable[[], None] | None:
        if _GET not in data:
            return None
        with self._lock:
            fault, self._fault = self._fault, None
        return fault

    def _accept(self) -> None:
        while True:
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
            with self._lock:
                self._socks += [client, server]
            for src, dst, reads in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, reads), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, client_side: bool) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                fault = self._take_fault(data) if client_side else None
                if fault is not None:
                    self.fired.set()  # a read is waiting on it now
                    fault()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks = []
