"""The remote tier: pages on an LMCache server (``lm://host:port``) via LMCache's RemoteBackend.

Used from the worker process; every call is bounded by ``timeout_s`` and none
raises.

LMCache behaviour worked around here (0.5.6), each next to its call:
- The lm:// connector has no timeouts, no delete, swallows errors in
  contains()/get_blocking() and desynchronises its stream after any error.
  We set a socket timeout, call the connector directly, and after any error
  or timeout drop the whole connection (its own event loop and staging
  memory included) and open a new one lazily, on the jittered backoff of
  tiers/reconnect.py from ``retry_interval_s``. Delete is emulated by overwriting with a tombstone.
- lm:// PUT has no reply: put() confirms with an EXIST on the same stream.
- The lm:// stream has no request ids, so one call at a time uses a
  connection: reads and writes get one connection each, so a read never
  waits behind a write (the worker reads and writes on separate threads).
- A PUT cut off mid-page leaves an entry on LMCache's server whose GET makes
  the server hang up; keys whose PUT was cut off or whose GET broke the
  stream are overwritten with a tombstone when the store reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.config import KVBMConfigError, parse_lm_url
from vllm_kvbm.tiers.lmcache_store import GIB, LMCacheStore, start_loop, stop_loop
from vllm_kvbm.tiers.page_format import flat_u8, valid_key, valid_page
from vllm_kvbm.tiers.reconnect import Reconnect

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


class _RemoteConn:
    """One connection generation: its own event loop, staging memory and socket.

    After any error it is thrown away whole, so a desynchronised stream,
    coroutines stuck on it and staging memory they leaked go with it.
    """

    def __init__(self, host: str, port: int, cfg, md, timeout_s: float, connect_s: float):
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        # LMCache connects without a timeout; probe first so an unreachable
        # host costs at most connect_s.
        socket.create_connection((host, port), timeout=max(connect_s, 0.05)).close()
        self.sock = None
        self.loop, self.thread = start_loop("kvbm-remote-io")
        try:
            self.staging = LocalCPUBackend(cfg, md)
            self.rb = RemoteBackend(cfg, md, self.loop, self.staging, dst_device="cpu")
            if self.rb.connection is None:
                raise ConnectionError(f"could not connect to {host}:{port}")
            self.conn = self.rb.connection
            inner = getattr(self.conn, "_connector", self.conn)
            self.sock = inner.client_socket
            self.sock.settimeout(timeout_s)  # bounds the blocking recv/send on the loop
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise

    def run(self, coro, timeout: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(max(timeout, 0.0))
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"remote call took longer than {timeout:.2f}s") from None

    def at_eof(self) -> bool:
        """True if the stream is unusable: with no call running, anything
        readable is either the server's hang-up or bytes nobody asked for."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv/send
            except OSError:
                pass
        if stop_loop(self.loop, self.thread, 0.2):
            if self.sock is not None:
                try:
                    self.sock.close()
                except OSError:
                    pass
        # A loop thread still stuck ends within the socket timeout; its
        # staging memory is released with it by the garbage collector.


class _Link:
    """One of the store's two connections (reads, writes): the connection of
    the moment, the lock that lets one call at a time use it, and when to
    try reconnecting."""

    def __init__(self, role: str, url: str, retry_interval_s: float):
        self.lock = threading.Lock()
        self.conn: _RemoteConn | None = None
        self.retry = Reconnect(retry_interval_s, "remote tier", url, f"for {role}")


class RemoteStore(LMCacheStore):
    """Pages on an LMCache server (``lm://host:port``) via LMCache's RemoteBackend.

    ``put`` returns True once the server has the page (a PUT followed by an
    EXIST on the same ordered stream). Every call is bounded by
    ``timeout_s``. On an error or timeout the connection is dropped and
    calls fail fast ("error"/False) until the next reconnect attempt (a
    jittered backoff from ``retry_interval_s``). Reads (``get_into``, ``contains``) and
    writes (``put``, ``remove``) each have a connection of their own, which
    one call at a time uses (the lm:// stream has no request ids): one reader
    and one writer thread never wait for each other.
    The server never evicts; ``remove`` writes a tombstone (a header-only
    page that reads back as "miss"). With ``page_secret`` pages are sealed
    (encrypted and authenticated, tombstones too) and named by keyed hashes;
    a page that does not open reads as "unauthenticated" and is overwritten
    with a tombstone.
    """

    name = "remote"

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", rank: int, secret: bytes | None, layout: str
    ) -> "RemoteStore":
        return cls(
            config.remote_url,
            info.page_bytes,
            info.tier_namespace,
            rank,
            info.key_namespace.tp_size,
            config.remote_timeout_s,
            page_secret=secret,
            layout=layout,
        )

    def __init__(
        self,
        url: str,
        page_bytes: int,
        namespace: str,
        rank: int,
        world_size: int,
        timeout_s: float = 2.0,
        *,
        retry_interval_s: float = 2.0,
        page_secret: bytes | None = None,
        layout: str = "",
    ):
        super().__init__(page_bytes, namespace, rank, world_size, page_secret, layout)
        self._host, self._port = parse_lm_url("remote_url", url)
        if not timeout_s > 0:
            raise KVBMConfigError(f"remote_timeout_s: must be positive, got {timeout_s!r}")
        self.url = url
        self._timeout_s = float(timeout_s)
        self._retry_s = float(retry_interval_s)
        self._cfg = self._Config.from_defaults(
            chunk_size=1,
            local_cpu=False,
            max_local_cpu_size=4 * self._phys / GIB,
            remote_url=url,
            remote_serde="naive",
            blocking_timeout_secs=max(1, int(timeout_s + 1)),
        )
        self._reads = _Link("reads", url, self._retry_s)
        self._writes = _Link("writes", url, self._retry_s)
        self._closed = False
        self._removed: set[bytes] = set()  # tombstoned by us: contains() -> False
        self._suspect: set[bytes] = set()  # puts cut off mid-stream: overwrite on reconnect
        self._overwritten = 0  # damaged pages overwritten (logged by count: a key is never logged)
        for link in (self._writes, self._reads):
            with link.lock:
                self._connection(link, time.monotonic() + self._timeout_s)

    # -- connection state ----------------------------------------------------
    def _connection(self, link: _Link, deadline: float) -> _RemoteConn | None:
        if link.conn is not None or self._closed:
            return link.conn
        if not link.retry.may_try():
            return None
        try:
            conn = _RemoteConn(
                self._host,
                self._port,
                self._cfg,
                self._md,
                self._timeout_s,
                deadline - time.monotonic(),
            )
        except Exception as e:  # noqa: BLE001
            link.retry.failed(e)
            return None
        link.conn = conn
        try:
            for key in list(self._suspect)[:256]:  # may hold a half-received page
                self._send(conn, key, None, deadline)
                self._suspect.discard(key)
        except Exception as e:  # noqa: BLE001
            self._drop(link, conn, e)
            return None
        return conn

    def _drop(self, link: _Link, conn: _RemoteConn, why) -> None:
        if link.conn is conn:
            link.conn = None
        link.retry.failed(why)
        conn.close()

    def _call(self, link: _Link, fn, fail):
        """Runs fn(conn, deadline) on ``link`` under its lock; any failure -> fail."""
        if self._closed:
            return fail
        deadline = time.monotonic() + self._timeout_s
        if not link.lock.acquire(timeout=self._timeout_s):
            return fail  # another call holds the stream for its whole timeout
        try:
            conn = self._connection(link, deadline)
            if conn is None:
                return fail
            try:
                result = fn(conn, deadline)
            except Exception as e:  # noqa: BLE001 - timeout, reset, desync, ...
                self._drop(link, conn, e)
                return fail
            # Up once the server answered: a frozen server still accepts
            # connections (the kernel completes them), so a connect is no sign.
            link.retry.answered()
            return result
        finally:
            link.lock.release()

    def _send(self, conn: _RemoteConn, key: bytes, page, deadline: float) -> None:
        """Puts page (None: a tombstone) and waits until it is on the wire."""
        shape = self._tomb_shape if page is None else self._shape
        mo = conn.staging.allocate(shape, torch.uint8, self._fmt, busy_loop=False)
        if mo is None:
            raise RuntimeError("remote staging memory exhausted")
        try:
            buf = flat_u8(mo.tensor)
            if page is None:
                self._codec.encode_tombstone(buf, key)
            else:
                self._codec.encode_into(buf, key, page)
            fut = conn.rb.submit_put_task(self._ckey(key), mo)
        finally:
            mo.ref_count_down()
        try:
            fut.result(max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            fut.cancel()
            self._suspect.add(key)
            raise TimeoutError("remote put timed out") from None

    # -- API -------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        if not valid_key(key) or not valid_page(page, self.page_bytes):
            return False
        key = bytes(key)

        def op(conn, deadline):
            self._send(conn, key, page, deadline)
            # lm:// PUT has no reply; the server handles a connection's
            # commands in order, so a following EXIST confirms it was stored.
            ck = self._ckey(key)
            if not conn.run(conn.conn.exists(ck), deadline - time.monotonic()):
                return False
            self._removed.discard(key)
            return True

        try:
            return self._call(self._writes, op, False)
        except Exception as e:  # noqa: BLE001
            logger.warning("remote tier: put failed: %s", e)
            return False

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        if not valid_key(key) or not valid_page(out, self.page_bytes):
            return "error"
        key = bytes(key)
        if key in self._removed:
            # Tombstoned by us: its tombstone went out on the write connection
            # and may not have reached the server before this read does.
            return "miss"

        def op(conn, deadline):
            try:
                mo = conn.run(conn.conn.get(self._ckey(key)), deadline - time.monotonic())
            except TimeoutError:
                raise
            except Exception:
                self._suspect.add(key)  # an entry LMCache cannot even read back
                raise
            if mo is None:
                if conn.at_eof():
                    # The server announced the page, then hung up: LMCache's
                    # server does that for an entry it stored from a PUT cut
                    # off mid-stream. Overwrite it once reconnected.
                    self._suspect.add(key)
                    raise ConnectionError("server closed the connection during a GET")
                return "miss"
            try:
                status = self._codec.decode_into(flat_u8(mo.tensor), key, out)
            finally:
                mo.ref_count_down()
            if status in ("corrupt", "unauthenticated"):
                self._overwritten += 1
                logger.warning(
                    "remote tier: %s page overwritten (%d by this worker so far)",
                    "corrupt"
                    if status == "corrupt"
                    else "unauthenticated (no valid MAC for this deployment's page secret)",
                    self._overwritten,
                )
                self._forget(key)
                self._send(conn, key, None, deadline)
            return status

        try:
            return self._call(self._reads, op, "error")
        except Exception as e:  # noqa: BLE001
            logger.warning("remote tier: get failed: %s", e)
            return "error"

    def contains(self, key: bytes) -> bool:
        if not valid_key(key) or bytes(key) in self._removed:
            return False
        ck = self._ckey(bytes(key))
        try:
            return bool(
                self._call(
                    self._reads,
                    lambda conn, deadline: conn.run(
                        conn.conn.exists(ck), deadline - time.monotonic()
                    ),
                    False,
                )
            )
        except Exception:  # noqa: BLE001
            return False

    def remove(self, key: bytes) -> None:
        if not valid_key(key):
            return
        key = bytes(key)
        self._forget(key)
        try:
            self._call(
                self._writes, lambda conn, deadline: self._send(conn, key, None, deadline), None
            )
        except Exception:  # noqa: BLE001
            pass

    def _forget(self, key: bytes) -> None:
        if len(self._removed) >= 65536:
            self._removed.clear()  # only an optimisation: the tombstone stays
        self._removed.add(key)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # new calls fail at once
        for link in (self._reads, self._writes):
            got = link.lock.acquire(timeout=self._timeout_s)
            try:
                if link.conn is not None:
                    link.conn.close()
                    link.conn = None
            finally:
                if got:
                    link.lock.release()
