"""Remote tier URLs (an LMCache server, a Redis/Valkey server or cluster) and
their TLS CA file. A URL never carries a password: vLLM logs its whole
kv_transfer_config at startup."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.config.parsing import parse_str


def parse_lm_url(key: str, value: Any) -> tuple[str, int]:
    """``lm://HOST:PORT`` -> (host, port): the one reading of an LMCache server URL
    (HOST a name, an IPv4 address or a bracketed IPv6 one)."""
    url = parse_str(key, value)
    parts = _split(url)
    host_port = _host_port(parts.netloc, None) if parts and parts.scheme == "lm" else None
    if host_port is None or parts.path or "?" in url or "#" in url:
        raise KVBMConfigError(
            f"{key}: {url!r} is not an LMCache server URL; write it as "
            f'"lm://HOST:PORT" (start one with: python -m lmcache.v1.server HOST PORT)'
        )
    return host_port


def check_remote_url(key: str, value: Any) -> str:
    """``value`` unchanged once parse_remote_url accepts it (the config keeps the text)."""
    target = parse_remote_url(key, value)
    if not target.resp and ":" in target.nodes[0][0]:
        # lmcache/v1/server and its lm_connector open AF_INET sockets only
        raise KVBMConfigError(
            f"{key}: {value!r} names an IPv6 address, but LMCache's server and client "
            f"(lm://) speak IPv4 only; use an IPv4 address or a host name with one, or a "
            f"redis:// server, which takes IPv6"
        )
    return value


def _split(url: str) -> SplitResult | None:
    """urllib's reading of ``url``; None where it refuses it (a bad [IPv6] host)
    or where the text has white space (urllib drops tabs and newlines)."""
    if any(c.isspace() for c in url):
        return None
    try:
        return urlsplit(url)
    except ValueError:
        return None


def _host_port(netloc: str, default_port: int | None) -> tuple[str, int] | None:
    """(host, port) of ``HOST[:PORT]`` or ``[IPv6][:PORT]``; None if malformed or
    a port outside 1..65535 (or none where ``default_port`` is None)."""
    parts = _split(f"//{netloc}")
    if parts is None or "@" in netloc or not netloc or any(c in netloc for c in _NOT_IN_HOST):
        return None
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number, or over 65535
        return None
    if not host or (port is None and ":" in netloc.rsplit("]", 1)[-1]):
        return None  # "h:" : a colon without a port
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    port = default_port if port is None else port
    return (host, port) if port is not None and 0 < port < 65536 else None


# remote_url schemes of a Redis/Valkey server (RESP), each with whether it is TLS.
_RESP_SCHEMES = {"redis": False, "rediss": True, "valkey": False, "valkeys": True}
REMOTE_URL_FORMS = (
    '"lm://HOST:PORT" (an LMCache server), "redis://[USER@]HOST[:PORT][/DB]" (a Redis or '
    "Valkey server; rediss:// with TLS; valkey:// and valkeys:// mean the same) or "
    '"redis+cluster://[USER@]HOST[:PORT][,HOST[:PORT]...]" (a Redis/Valkey Cluster by its '
    "seed nodes; also rediss+cluster://, valkey+cluster://, valkeys+cluster://)"
)
_PASSWORD_KEYS = "remote_password_file (a file holding it) or KVBM_REMOTE_PASSWORD"
_NOT_IN_HOST = set(" \t\r\n/?#,%")


@dataclass(frozen=True)
class RemoteTarget:
    """A parsed ``remote_url``. It never holds a password (a URL with one is refused)."""

    scheme: str  # "lm", "redis", "rediss", "valkey", "valkeys"
    nodes: tuple[tuple[str, int], ...]  # one, or a cluster's seed nodes
    cluster: bool = False
    db: int = 0
    username: str | None = None

    @property
    def resp(self) -> bool:
        """A Redis/Valkey server (RESP), not LMCache's lm:// server."""
        return self.scheme in _RESP_SCHEMES

    @property
    def tls(self) -> bool:
        return _RESP_SCHEMES.get(self.scheme, False)

    def __str__(self) -> str:
        """The URL as logs show it (it has no secret to hide)."""
        user = f"{self.username}@" if self.username else ""
        nodes = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        db = f"/{self.db}" if self.db else ""
        return f"{self.scheme}{'+cluster' if self.cluster else ''}://{user}{nodes}{db}"


def redact_url(url: str) -> str:
    """``url`` with any user:password and query string masked, for messages."""
    head, sep, tail = url.partition("://")
    user, at, host = tail.rpartition("@")
    if at and ":" in user:
        tail = "***:***@" + host
    return head + sep + re.sub(r"[?#].*$", "?***", tail)


def parse_remote_url(key: str, value: Any) -> RemoteTarget:
    """The one reading of ``remote_url``: an LMCache server or a Redis/Valkey server/cluster.

    A password in the URL is refused, naming the keys that take it: vLLM logs
    the whole kv_transfer_config at startup. Messages never show it.
    """
    url = parse_str(key, value)
    shown = redact_url(url)
    if url.startswith("lm://") and shown == url:
        host, port = parse_lm_url(key, url)
        return RemoteTarget("lm", ((host, port),))

    def bad(why: str) -> KVBMConfigError:
        return KVBMConfigError(f"{key}: {shown!r} {why}; write it as {REMOTE_URL_FORMS}")

    parts = _split(url)
    scheme, plus, variant = (parts.scheme if parts else "").partition("+")
    if (
        parts is None
        or scheme not in _RESP_SCHEMES
        or variant not in (("cluster",) if plus else ("",))
    ):
        raise bad("is not a remote tier URL")
    cluster = bool(plus)
    if parts.password is not None:
        raise KVBMConfigError(
            f"{key}: {shown!r} has a password in it, which would be logged (vLLM logs its "
            f'kv_transfer_config); remove it from the URL ("{scheme}://USER@HOST:PORT") '
            f"and give it with {_PASSWORD_KEYS}"
        )
    username = parts.username
    if username is not None and (not username or "," in username):
        raise bad(f"has an empty or malformed user name {username!r}")
    if "?" in url or "#" in url:
        raise bad("has options (?...), which are not read")
    db = 0
    if parts.path:
        db_text = parts.path[1:]
        if cluster:
            raise bad("names a database, but a cluster has only database 0")
        if not db_text.isdigit():
            raise bad(f"has a database {db_text!r} that is not a number")
        db = int(db_text)
    where = parts.netloc.rpartition("@")[2]
    nodes = []
    for part in where.split(",") if cluster else [where]:
        node = _host_port(part, 6379)
        if node is None:
            raise bad(f"has a bad HOST:PORT {part!r}")
        nodes.append(node)
    return RemoteTarget(scheme, tuple(nodes), cluster, db, username)


def check_directory_url(key: str, value: Any) -> str:
    """``value`` unchanged once it names one Redis/Valkey server (the peer
    directory: ``redis://[USER@]HOST[:PORT][/DB]``, ``rediss://`` with TLS);
    a password in it is refused as in remote_url."""
    target = parse_remote_url(key, value)
    if not target.resp or target.cluster:
        raise KVBMConfigError(
            f"{key}: {redact_url(str(value))!r} is not one Redis or Valkey server; write it as "
            f'"redis://[USER@]HOST[:PORT][/DB]" (rediss:// with TLS; valkey:// and '
            f"valkeys:// mean the same); the directory is small: one server, not a cluster"
        )
    return value


def parse_ca_file(key: str, value: Any) -> str:
    path = parse_str(key, value)
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise KVBMConfigError(
            f"{key}: {path!r} is not a file; set it to the PEM file of the CA that signed the "
            f"Redis/Valkey server's certificate, or remove it to use the system's CAs"
        )
    if not os.access(os.path.expanduser(path), os.R_OK):
        raise KVBMConfigError(f"{key}: {path!r} is not readable by this process")
    return os.path.abspath(os.path.expanduser(path))


def check_remote_tls(kwargs: dict, sources: dict) -> None:
    """A CA file needs a TLS remote_url or peer_directory_url (``kwargs``:
    the parsed fields); it applies to both."""
    url = kwargs.get("remote_url")
    directory = kwargs.get("peer_directory_url")
    if kwargs.get("remote_tls_ca_file") is not None and not any(
        u is not None and parse_remote_url("remote_url", u).tls for u in (url, directory)
    ):
        source = sources["remote_tls_ca_file"]
        if source != "remote_tls_ca_file":
            source += " (sets remote_tls_ca_file)"
        raise KVBMConfigError(
            f"{source}: it only applies to a TLS remote_url or peer_directory_url (rediss://, "
            f"valkeys://, ...+cluster://), not {url!r}; use one or remove it"
        )
