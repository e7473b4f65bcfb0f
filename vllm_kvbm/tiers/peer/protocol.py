"""What crosses a peer's control endpoint: endpoints, and the two requests.

A serving peer (a worker keeping its own pool file, or the kvbm-pool
process) answers on ``tcp://HOST:PORT`` for TP rank 0 and on ``PORT + r``
for rank r (``rank_endpoint``), so a reader of rank r, which reads the pool
file of its own rank, asks the peer's rank r. A request is a ZMQ message of
one JSON frame; a reply a JSON frame and, for ``hello``, the NIXL agent
metadata as a second frame:

- ``hello {file, scope, known}`` -> ``{ok, agent, incarnation, metadata_version,
  base, length, stored_bytes, nslots, ways, table_off, data_off, stride,
  file_incarnation}`` (+ metadata, left out when ``known`` names the
  incarnation and metadata version the reader already loaded). ``file`` is the
  pool file's name (layout.file_name: the namespace, page size, rank and
  world), ``scope`` its scope digest in hex (layout.scope_digest: what its
  pages verify against, the KV layout included): a file of another scope is
  refused (``ok: false``, ``error``), as is one the peer does not hold.
- ``lookup {file, scope?, keys}`` -> ``{ok, found}``: which of the table keys
  (hex) the file holds now (memory reads on the peer): what a scheduler may
  ask without NIXL. The scope may be left out (a scheduler knows no KV
  layout; the table is readable by any peer anyway).

Nothing secret crosses it: table keys are keyed hashes under a page secret,
and the metadata is what any NIXL peer publishes. What it gives access to is
the point: the pool's whole mapping, to whoever connects (docs/peer-tier.md).
"""

from __future__ import annotations

import json
import re

VERSION = 1
# Replies and requests larger than this are refused (a lookup of ~10k keys).
MAX_MESSAGE_BYTES = 1 << 20

_ENDPOINT = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ValueError naming the fix."""
    m = _ENDPOINT.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(
            f"{text!r} is not a peer control endpoint; write it as "
            f"tcp://HOST:PORT (an IPv6 address in brackets)"
        )
    return m.group(1), int(m.group(2))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint that serves TP rank ``rank``'s pool file: PORT + rank."""
    host, port = parse_endpoint(endpoint)
    if port + rank > 65535:
        raise ValueError(f"{endpoint}: rank {rank}'s port {port + rank} is past 65535")
    return f"tcp://{host}:{port + rank}"


def endpoint_of(host: str, port: int) -> str:
    """The endpoint a server bound to ``host`` advertises (a wildcard bind
    names this machine's host name: peers must reach it)."""
    if host in ("0.0.0.0", "::", "*", ""):
        import socket

        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def encode(message: dict, blob: bytes | None = None) -> list[bytes]:
    frames = [json.dumps(message, separators=(",", ":")).encode()]
    if blob is not None:
        frames.append(blob)
    return frames


def decode(frames: list[bytes]) -> tuple[dict, bytes | None]:
    """(message, blob); ValueError for anything that is not one."""
    if not frames or len(frames) > 2 or sum(len(f) for f in frames) > MAX_MESSAGE_BYTES:
        raise ValueError("not a peer message")
    message = json.loads(frames[0])
    if not isinstance(message, dict):
        raise ValueError("not a peer message")
    return message, (frames[1] if len(frames) == 2 else None)
