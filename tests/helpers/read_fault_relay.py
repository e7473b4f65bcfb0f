"""A TCP relay on 127.0.0.1 in front of a real Redis server that runs a fault
at the moment a page is read.

Lookups (EXISTS) and writes (SET) pass as they come. Once ``arm(fault)`` is
called, the first GET a client sends waits on its connection until
``fault()`` returned (delete the pages, kill the server, stall past the
client's timeout), then goes on to the server: the fault lands exactly between
a hit's lookup and its read, as an eviction or an outage at that moment would.
"""

from __future__ import annotations

import threading
from typing import Callable

from helpers.throttled_proxy import ThrottledProxy

# A GET as redis-py sends it (CONFIG GET and the like are longer arrays).
_GET = b"*2\r\n$3\r\nGET\r\n"


class ReadFaultRelay(ThrottledProxy):
    def __init__(self, target_port: int):
        self._lock = threading.Lock()
        self._fault: Callable[[], None] | None = None
        self.fired = threading.Event()  # set once a read waits on the fault
        super().__init__(target_port, None, before_send=self._before_read)

    def arm(self, fault: Callable[[], None]) -> None:
        with self._lock:
            self._fault = fault
            self.fired.clear()

    def _before_read(self, data: bytes) -> None:
        if _GET not in data:
            return
        with self._lock:
            fault, self._fault = self._fault, None
        if fault is not None:
            self.fired.set()
            fault()
