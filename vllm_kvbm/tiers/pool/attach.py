"""A worker's pool file: from the kvbm-pool process, or its own.

With ``pool_socket`` set, the worker asks the kvbm-pool process listening
there (tools/pool.py) for the file of its namespace, rank and page size: the
pool creates it (or finds it again) in its directory, keeps it mapped and
serves it to peers, and the worker maps the same file and writes into it. So
the pages outlive the engine, and peers keep reading them while it restarts.
A worker that cannot attach (no pool process, a refusal, another directory)
keeps a pool file of its own, and serves it to peers itself when
``pool_serve_port`` is set: one warning line says so and why.

The request on the Unix socket is one length-prefixed JSON message each way
(``send_message``/``recv_message``), bounded by ATTACH_TIMEOUT_S:

    {"op": "attach", "version": 1, "name", "name_digest", "scope_digest",
     "stored_bytes", "nslots", "ways", "rank", "pid"}
 -> {"ok": true, "path", "nslots", "ways", "endpoint"}  |  {"ok": false, "error"}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.tiers.pool.pool_file import PoolFile, PoolSpec, open_pool

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig

logger = logging.getLogger(__name__)

VERSION = 1
ATTACH_TIMEOUT_S = 30.0  # the pool may be creating (reserving) a large file
MAX_MESSAGE = 1 << 16
_LEN = struct.Struct(">I")


class AttachRefused(Exception):
    """The pool process answered no (the reason), or answered nonsense."""


def send_message(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict:
    """One message; ValueError for a malformed one, ConnectionError at EOF."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes")
    message = json.loads(_recv_exactly(sock, n))
    if not isinstance(message, dict):
        raise ValueError("not a message")
    return message


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(n - got)
        if not part:
            raise ConnectionError("closed by the other side")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def ping_message() -> dict:
    return {"op": "ping", "pid": os.getpid()}


def attach_message(spec: PoolSpec, rank: int) -> dict:
    g = spec.geometry
    return {
        "op": "attach",
        "version": VERSION,
        "name": spec.name,
        "name_digest": spec.name_digest.hex(),
        "scope_digest": spec.scope_digest.hex(),
        "stored_bytes": g.stored_bytes,
        "nslots": g.nslots,
        "ways": g.ways,
        "rank": rank,
        "pid": os.getpid(),
    }


def ask(socket_path: str, message: dict, timeout_s: float) -> dict:
    """kvbm-pool's reply to ``message`` (one request on its socket, bounded
    by ``timeout_s``). Raises OSError, TimeoutError, AttachRefused."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(socket_path)
        send_message(sock, message)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            return recv_message(sock)
        except ValueError as err:
            raise AttachRefused(f"an answer that is not kvbm-pool's ({err})") from None
        except ConnectionError as err:
            raise OSError(str(err)) from None


def ask_attach(
    socket_path: str, spec: PoolSpec, rank: int, timeout_s: float = ATTACH_TIMEOUT_S
) -> dict:
    """kvbm-pool's yes to holding ``spec``'s file (it creates it or finds it
    again: asking twice is harmless). Raises OSError, TimeoutError,
    AttachRefused (a no, or a file elsewhere than this engine's pool_dir)."""
    reply = ask(socket_path, attach_message(spec, rank), timeout_s)
    if not reply.get("ok"):
        raise AttachRefused(str(reply.get("error", "refused")))
    path = reply.get("path")
    if path != spec.path:
        raise AttachRefused(
            f"kvbm-pool keeps this file at {path!r}, not in this engine's pool_dir "
            f"{spec.directory!r}; start kvbm-pool with --dir {spec.directory} (or set "
            f"pool_dir to its directory)"
        )
    return reply


def attach(
    socket_path: str, spec: PoolSpec, rank: int, timeout_s: float = ATTACH_TIMEOUT_S
) -> tuple[PoolFile, str | None]:
    """The file kvbm-pool at ``socket_path`` holds for ``spec``, mapped, and
    the endpoint it serves peers on (None: it does not). Raises OSError,
    TimeoutError, AttachRefused."""
    reply = ask_attach(socket_path, spec, rank, timeout_s)
    try:
        pool = open_pool(spec, create=False)
    except KVBMConfigError as err:
        raise AttachRefused(str(err)) from None
    endpoint = reply.get("endpoint")
    return pool, endpoint if isinstance(endpoint, str) else None


def open_engine_pool(config: "KVBMConfig", spec: PoolSpec, rank: int):
    """(PoolFile, PeerServer or None) for this worker: kvbm-pool's file when
    it attaches, else its own (and its own peer server with pool_serve_port)."""
    serve = config.pool_serve_port
    if config.pool_socket is not None:
        try:
            pool, endpoint = attach(config.pool_socket, spec, rank)
            pool.served_at = _valid_endpoint(endpoint)  # kvbm-pool's, rank 0's
            from vllm_kvbm.tiers.pool.watch import PoolWatch

            pool.watch = PoolWatch(config.pool_socket, spec, rank)
            logger.info(
                "KVBM: pool tier: attached to kvbm-pool at %s: %s (%d slots); %s",
                config.pool_socket,
                pool.path,
                pool.geometry.nslots,
                f"served to peers by kvbm-pool at {endpoint}"
                if endpoint
                else "kvbm-pool serves no peers",
            )
            return pool, None
        except (OSError, TimeoutError, AttachRefused) as err:
            logger.warning(
                "KVBM: pool tier: cannot attach to kvbm-pool at %s (%s); this worker keeps "
                "its own pool file %s%s",
                config.pool_socket,
                err,
                spec.path,
                f" and serves it to peers itself on port {serve + rank}" if serve else "",
            )
    pool = open_pool(spec)
    server = None
    try:
        if serve is not None:
            server = start_server(pool, config.pool_serve_host, serve + rank)
            if server is not None:
                from vllm_kvbm.tiers.peer.protocol import endpoint_of

                pool.served_at = endpoint_of(config.pool_serve_host, serve)
        if config.pool_socket is None:
            logger.info(
                "KVBM: pool tier: %s (%d slots of %d bytes)%s",
                pool.path,
                pool.geometry.nslots,
                pool.geometry.stride,
                f"; served to peers at {server.endpoint}" if server else "",
            )
    except BaseException:
        pool.close()
        raise
    return pool, server


def _valid_endpoint(endpoint: str | None) -> str | None:
    """kvbm-pool's endpoint (its --serve-port: rank 0's), if it is one."""
    if endpoint is None:
        return None
    from vllm_kvbm.tiers.peer.protocol import parse_endpoint

    try:
        parse_endpoint(endpoint)
    except ValueError:
        return None
    return endpoint


def start_server(pool: PoolFile, host: str, port: int):
    """A peer server for ``pool`` on host:port; None (said once) when it
    cannot start: the pool still serves this engine."""
    from vllm_kvbm.tiers.peer.server import PeerServer

    try:
        server = PeerServer(host, port)
    except Exception as err:  # noqa: BLE001 - a port in use, no NIXL: not fatal
        logger.warning(
            "KVBM: pool tier: cannot serve %s to peers on %s:%d (%s); peers "
            "cannot read this engine's pool",
            pool.path,
            host,
            port,
            err,
        )
        return None
    try:
        server.serve(pool)
    except Exception as err:  # noqa: BLE001
        logger.warning(
            "KVBM: pool tier: cannot register %s with NIXL (%s); peers cannot "
            "read this engine's pool",
            pool.path,
            err,
        )
        server.close()
        return None
    return server
