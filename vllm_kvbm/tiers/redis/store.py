"""The remote tier on a Redis or Valkey server or cluster, through redis-py.

Why not LMCache 0.5.6's RESP connectors (tried against a real
``redis-server`` with ``requirepass``, a wrong password and SIGSTOP):
- ``RedisConnector`` (``redis://``, redis-py asyncio) takes the password
  only inside the URL and LMCache logs that URL at INFO ("Creating connector
  for URL: redis://:<password>@..."); it sets no socket timeout (redis-py's
  5 s default, plus its retries); every page is two keys (``...metadata`` and
  ``...kv_bytes``) that an LRU server evicts independently; there is no delete.
- ``RESPConnector`` (``resp://``, LMCache's native client): with a wrong
  password the first call never returns (its worker logs "AUTH failed" and
  the request is never answered); no timeouts, no TLS, no cluster.
- ``ValkeyConnector`` needs ``valkey-glide-sync``, which is not installed.
So this store uses redis-py's synchronous client directly
(``connection.py``): socket timeouts on every call, no retries, TLS,
Redis/Valkey Cluster, a password kept out of every message, and a refused
password at startup as a ``KVBMConfigError``.

A page is one key: the name ``page_name()`` gives (per TP rank; keyed by the
page secret where there is one), holding the page (``PageCodec``: header +
payload + checksum; with a page secret the payload is encrypted and
authenticated). One key per page means an LRU server (``maxmemory-policy
allkeys-lru``) drops whole pages only; a page that fails verification (a
flipped byte, a foreign value) is "corrupt" (or "unauthenticated") and
deleted. Used from the worker's remote I/O thread; no call raises.

Reads: on a server (not a cluster) ``get_into`` sends GET on a connection of
redis-py's pool and receives the reply itself, the page straight into the
host slot, checked (or decrypted) a MiB at a time as it arrives: redis-py's
pure-Python reply parser copies a page through its buffers several times
(about 0.2-0.4 GB/s for 16 MiB pages here, against over 1 GB/s received
directly: docs/benchmarks.md, benchmarks/bench_tiers.py --bandwidth-only).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING

import numpy as np
import redis
import torch

from vllm_kvbm.config import parse_remote_url
from vllm_kvbm.config.secrets import Secret
from vllm_kvbm.config.urls import RemoteTarget
from vllm_kvbm.tiers.base import TierStore
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.page_format import HEADER_BYTES, valid_key, valid_page
from vllm_kvbm.tiers.page_names import page_namer
from vllm_kvbm.tiers.redis.connection import RedisLink

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)
_FAILED = object()


class RedisStore(TierStore):
    """Pages on a Redis/Valkey server or cluster (``redis://``, ``rediss://``,
    ``valkey://``, ``valkeys://``, ``...+cluster://``).

    ``put`` returns True once the server stored the page (SET answered).
    Every call is bounded by ``timeout_s`` per socket operation; while the
    server is unreachable calls fail at once ("error"/False) and the link is
    re-made in the background on a jittered backoff from ``retry_interval_s``.
    """

    name = "remote"

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", rank: int, secret: bytes | None, layout: str
    ) -> "RedisStore":
        return cls(
            parse_remote_url("remote_url", config.remote_url),
            config.remote_password,
            info.page_bytes,
            info.tier_namespace,
            rank,
            info.key_namespace.tp_size,
            config.remote_timeout_s,
            page_secret=secret,
            tls_ca_file=config.remote_tls_ca_file,
            layout=layout,
        )

    def __init__(
        self,
        target: RemoteTarget,
        password: Secret | None,
        page_bytes: int,
        namespace: str,
        rank: int,
        world_size: int,
        timeout_s: float = 2.0,
        *,
        retry_interval_s: float = 2.0,
        page_secret: bytes | None = None,
        tls_ca_file: str | None = None,
        layout: str = "",
    ):
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.page_bytes = page_bytes
        self.url = str(target)
        self._codec = PageCodec(
            namespace, page_bytes, page_secret, rank=rank, world_size=world_size, layout=layout
        )
        self._page_name = page_namer(namespace, page_bytes, rank, world_size, page_secret)
        self._link = RedisLink(
            target, password, timeout_s, retry_interval_s, tls_ca_file=tls_ca_file
        )
        # Each writing thread encodes into its own buffer, reused for every put:
        # a fresh one per page costs its page faults (SET has sent it all
        # before put returns).
        self._scratch = threading.local()
        if rank == 0:
            self._check_eviction_policy()

    def _check_eviction_policy(self) -> None:
        """Warns once if the server would refuse pages when full instead of evicting.
        CONFIG is often not allowed (managed servers, ACLs): then nothing is said."""

        def policy(client):
            if self._link.target.cluster:
                return None
            return client.config_get("maxmemory-policy").get("maxmemory-policy")

        try:
            found = self._link.call(policy, None, "CONFIG GET")
        except Exception:  # noqa: BLE001
            found = None
        if isinstance(found, bytes):
            found = found.decode()
        if found is not None and not str(found).startswith("allkeys-"):
            logger.warning(
                "KVBM: remote tier %s has maxmemory-policy %s; once full it refuses "
                "new pages (or keeps only expiring keys) instead of dropping old ones. "
                "Set maxmemory and maxmemory-policy allkeys-lru on it",
                self.url,
                found,
            )

    # -- API -------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        if not valid_key(key) or not valid_page(page, self.page_bytes):
            return False
        key = bytes(key)
        try:
            name = self._page_name(key)
            if not self._codec.keyed and not self._link.target.cluster:
                # In the clear the payload is the slot's bytes: checksummed
                # there and sent from there, behind its header.
                view = memoryview(page.numpy())
                signer = self._codec.signer(key)
                signer.seal(view, view)  # without a secret: checksums, writes nothing
                hdr = signer.header()
                return bool(self._link.call(lambda c: _set_page(c, name, hdr, view), False, "put"))
            buf = getattr(self._scratch, "buf", None)
            if buf is None:
                buf = self._scratch.buf = torch.empty(self._codec.stored_bytes, dtype=torch.uint8)
            self._codec.encode_into(buf, key, page)  # sealed: encrypted into buf
            data = memoryview(buf.numpy())  # sent without another copy
            return bool(self._link.call(lambda c: c.set(name, data), False, "put"))
        except Exception as e:  # noqa: BLE001
            logger.warning("KVBM: remote tier: put failed: %s", self._link.safe(e))
            return False

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        if not valid_key(key) or not valid_page(out, self.page_bytes):
            return "error"
        key = bytes(key)
        try:
            name = self._page_name(key)
            if self._link.target.cluster:
                data = self._link.call(lambda c: c.get(name), _FAILED, "get")
                if data is _FAILED:
                    return "error"
                if data is None:
                    return "miss"
                status = _decode_into(self._codec, data, key, out)
            else:
                status = self._link.call(
                    lambda c: _get_into_slot(c, name, self._codec, key, out), "error", "get"
                )
            if status in ("corrupt", "unauthenticated"):  # the latter: a page MAC failed
                logger.warning("KVBM: remote tier: %s page %s deleted", status, name)
                self._link.call(lambda c: c.delete(name), 0, "delete")
            return status
        except Exception as e:  # noqa: BLE001
            logger.warning("KVBM: remote tier: get failed: %s", self._link.safe(e))
            return "error"

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """One round trip (a pipeline of EXISTS) for many keys."""
        names = [self._page_name(bytes(k)) if valid_key(k) else None for k in keys]
        wanted = [n for n in names if n is not None]
        if not wanted:
            return [False] * len(keys)

        def exists(client):
            pipe = client.pipeline(transaction=False)
            for n in wanted:
                pipe.exists(n)
            return pipe.execute()

        try:
            found = iter(self._link.call(exists, [0] * len(wanted), "exists"))
        except Exception:  # noqa: BLE001
            return [False] * len(keys)
        return [n is not None and bool(next(found, 0)) for n in names]

    def remove(self, key: bytes) -> None:
        if not valid_key(key):
            return
        name = self._page_name(bytes(key))
        try:
            self._link.call(lambda c: c.delete(name), 0, "delete")
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self._link.close()


def _decode_into(codec: PageCodec, data: bytes, key: bytes, out: torch.Tensor) -> str:
    """PageCodec.decode_into, reading the reply where it lies: the payload is
    checked (or decrypted) straight from the reply's bytes into ``out``, with
    no copy of the reply into a tensor first."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        return "corrupt"
    check = codec.start_verify(bytes(view[:HEADER_BYTES]), key)
    if isinstance(check, str):
        return check
    payload, dst = view[HEADER_BYTES:], memoryview(out.numpy())
    if check.opens and len(payload):  # a sealed page, decrypted into out
        if len(payload) != len(dst):
            return "corrupt"
        check.update_into(payload, dst)
        return check.finish(out)
    if len(payload):
        check.update(payload)
    status = check.finish(payload)
    if status == "ok":  # finish checked the length; memmove copies without the GIL
        ctypes.memmove(
            out.data_ptr(), np.frombuffer(data, np.uint8).ctypes.data + HEADER_BYTES, len(payload)
        )
    return status


# Bytes a page is received and checked in: checked (or decrypted) right after
# it arrives, while it is still in the CPU's cache.
_CHUNK = 1 << 20


class _Reply:
    """Reads one RESP reply straight off a socket: a line, then bytes into
    the caller's buffers (a bulk string lands where it is wanted, without
    redis-py's parser copying it through its own buffers)."""

    def __init__(self, sock):
        self._sock = sock
        self._buf = bytearray(64 << 10)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def _recv(self, into: memoryview) -> int:
        n = self._sock.recv_into(into)
        if not n:
            raise redis.ConnectionError("the server closed the connection")
        return n

    def line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                text, self._start = bytes(self._buf[self._start : i]), i + 2
                return text
            if self._end == len(self._buf):
                raise redis.ConnectionError("a reply line longer than 64 KiB")
            self._end += self._recv(self._view[self._end :])

    def read_into(self, dst: memoryview) -> None:
        have = min(self._end - self._start, len(dst))
        if have:
            dst[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < len(dst):
            have += self._recv(dst[have:])


def _set_page(client, name: str, hdr: bytes, payload: memoryview) -> bool:
    """SET ``name`` to ``hdr + payload`` on one connection of the client's
    pool, the payload sent from where it lies (no page-sized copy)."""
    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants the command's name
        conn = pool.get_connection("SET")
    try:
        key = name.encode()
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(hdr) + len(payload))
        # redis-py sends each part with sendall and closes the connection
        # on a failure; read_response raises an error the server answered
        conn.send_packed_command([head + hdr, payload, b"\r\n"], check_health=False)
        return conn.read_response() in (b"OK", "OK", True)
    finally:
        pool.release(conn)


def _get_into_slot(client, name: str, codec: PageCodec, key: bytes, out: torch.Tensor) -> str:
    """GET ``name`` on one connection of the client's pool, the page received
    straight into ``out`` and checked (or decrypted) chunk by chunk as it
    arrives. -> get_into's status. A connection left mid-reply (a value of
    another size, a header that decides the page, a socket error) is closed,
    so the pool never hands out a connection with bytes still to read."""
    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants the command's name
        conn = pool.get_connection("GET")
    clean = False
    try:
        conn.send_command("GET", name)
        reply = _Reply(conn._sock)
        line = reply.line()
        if line[:1] == b"-":  # an error the server answered (e.g. WRONGTYPE)
            clean = True
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line == b"_":  # RESP3's null (redis-py 8 speaks RESP3)
            clean = True
            return "miss"
        if line[:1] != b"$":
            raise redis.ConnectionError(f"unexpected reply to GET: {line[:16]!r}")
        length = int(line[1:])
        if length < 0:  # RESP2's null
            clean = True
            return "miss"
        if length != codec.stored_bytes:
            return "corrupt"  # another page size, or not a page
        hdr = bytearray(HEADER_BYTES)
        reply.read_into(memoryview(hdr))
        check = codec.start_verify(bytes(hdr), key)
        if isinstance(check, str):
            return check
        dst = memoryview(out.numpy())
        for off in range(0, len(dst), _CHUNK):
            part = dst[off : off + _CHUNK]
            reply.read_into(part)
            check.update(part)  # checksummed, or decrypted in place
        end = bytearray(2)
        reply.read_into(memoryview(end))
        if end != b"\r\n":
            raise redis.ConnectionError("a bulk reply not ended by CRLF")
        clean = True
        return check.finish(out)
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)
