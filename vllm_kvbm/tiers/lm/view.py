"""An LMCache server (``lm://``) as the scheduler sees it: EXIST, without LMCache."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from vllm_kvbm.config import parse_lm_url
from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.base import TierView
from vllm_kvbm.tiers.lm.protocol import REPLY_BYTES, exist_reply, exist_request
from vllm_kvbm.tiers.page_names import page_namer
from vllm_kvbm.tiers.reconnect import Reconnect

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo


class RemoteView(TierView):
    """The remote tier as the scheduler sees it: EXIST on the server.

    Rank 0's page stands for all ranks; a rank missing its page fails that
    load, which vLLM then recomputes. Every call is bounded by ``timeout_s``;
    after a failure the connection is re-made on a jittered backoff from
    ``retry_interval_s`` and calls answer False (a miss) meanwhile.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        namespace: str,
        page_bytes: int,
        world_size: int,
        timeout_s: float = 2.0,
        retry_interval_s: float = 2.0,
        secret: bytes | None = None,
    ):
        self.url = url
        self._addr = parse_lm_url("remote_url", url)
        self._name = page_namer(namespace, page_bytes, 0, world_size, secret)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._retry = Reconnect(retry_interval_s, "remote tier", url, "for lookups")

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", secret: bytes | None
    ) -> "RemoteView":
        return cls(
            config.remote_url,
            info.tier_namespace,
            info.page_bytes,
            info.key_namespace.tp_size,
            config.remote_timeout_s,
            secret=secret,
        )

    def contains(self, key: PageKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[PageKey]) -> list[bool]:
        """One round trip for all ``keys``: the server answers a connection's
        requests in order, so they are sent at once and the replies read
        back; the whole exchange is bounded by ``timeout_s``."""
        if not keys:
            return []
        with self._lock:
            sock = self._connection()
            if sock is None:
                return [False] * len(keys)
            deadline = time.monotonic() + self._timeout_s
            try:
                sock.sendall(b"".join(exist_request(self._name(key)) for key in keys))
                want = REPLY_BYTES * len(keys)
                reply = bytearray()
                while len(reply) < want:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no answer within {self._timeout_s}s")
                    sock.settimeout(left)
                    quick_ack(sock)
                    chunk = sock.recv(want - len(reply))
                    if not chunk:
                        raise ConnectionError("server closed the connection")
                    reply += chunk
                found = [
                    exist_reply(bytes(reply[i : i + REPLY_BYTES]))
                    for i in range(0, want, REPLY_BYTES)
                ]
            except (OSError, ValueError) as err:
                self._drop(err)
                return [False] * len(keys)
            self._retry.answered()
            return found

    @property
    def down(self) -> bool:
        return self._retry.state == "down"

    @property
    def link(self) -> Reconnect:
        return self._retry

    def _connection(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        if not self._retry.may_try():
            return None
        try:
            sock = socket.create_connection(self._addr, timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as err:
            self._drop(err)
            return None
        self._sock = sock
        return sock

    def _drop(self, why) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._retry.failed(why)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def quick_ack(sock: socket.socket) -> None:
    """ACK what arrives on ``sock`` at once (Linux resets this after each
    ACK, so it is set before every recv).
    The server writes each EXIST reply on its own with Nagle's algorithm on:
    the second waits for the ACK of the first, which a delayed ACK holds
    about 40 ms, so every question of more than one key took 40 ms."""
    quickack = getattr(socket, "TCP_QUICKACK", None)
    if quickack is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
        except OSError:
            pass
