"""Remote tier URLs (an LMCache server, a Redis/Valkey server or cluster) and
their TLS CA file. A URL never carries a password: vLLM logs its whole
kv_transfer_config at startup."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.config.parsing import parse_str


def parse_lm_url(key: str, value: Any) -> tuple[str, int]:
    """``lm://HOST:PORT`` -> (host, port): the one reading of an LMCache server URL."""
    url = parse_str(key, value)
    m = re.match(r"^lm://([^:/]+):([0-9]+)$", url)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise KVBMConfigError(
            f"{key}: {url!r} is not an LMCache server URL; write it as "
            f"\"lm://HOST:PORT\" (start one with: python -m lmcache.v1.server HOST PORT)")
    return m.group(1), int(m.group(2))


def check_remote_url(key: str, value: Any) -> str:
    """``value`` unchanged once parse_remote_url accepts it (the config keeps the text)."""
    parse_remote_url(key, value)
    return value


# remote_url schemes of a Redis/Valkey server (RESP), each with whether it is TLS.
_RESP_SCHEMES = {"redis": False, "rediss": True, "valkey": False, "valkeys": True}
REMOTE_URL_FORMS = (
    "\"lm://HOST:PORT\" (an LMCache server), \"redis://[USER@]HOST[:PORT][/DB]\" (a Redis or "
    "Valkey server; rediss:// with TLS; valkey:// and valkeys:// mean the same) or "
    "\"redis+cluster://[USER@]HOST[:PORT][,HOST[:PORT]...]\" (a Redis/Valkey Cluster by its "
    "seed nodes; also rediss+cluster://, valkey+cluster://, valkeys+cluster://)")
_PASSWORD_KEYS = "remote_password_file (a file holding it) or KVBM_REMOTE_PASSWORD"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:/@,\[\]?#%]+)(?::([0-9]+))?$")


@dataclass(frozen=True)
class RemoteTarget:
    """A parsed ``remote_url``. It never holds a password (a URL with one is refused)."""

    scheme: str                              # "lm", "redis", "rediss", "valkey", "valkeys"
    nodes: tuple[tuple[str, int], ...]       # one, or a cluster's seed nodes
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

    m = re.match(r"^([a-z]+)(\+cluster)?://(.*)$", url)
    if not m or m.group(1) not in _RESP_SCHEMES:
        raise bad("is not a remote tier URL")
    scheme, cluster, rest = m.group(1), bool(m.group(2)), m.group(3)
    username = None
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        if ":" in userinfo:
            raise KVBMConfigError(
                f"{key}: {shown!r} has a password in it, which would be logged (vLLM logs its "
                f"kv_transfer_config); remove it from the URL (\"{scheme}://USER@HOST:PORT\") "
                f"and give it with {_PASSWORD_KEYS}")
        if not userinfo or any(c.isspace() or c in "/?#," for c in userinfo):
            raise bad(f"has an empty or malformed user name {userinfo!r}")
        username = userinfo
    if "?" in rest or "#" in rest:
        raise bad("has options (?...), which are not read")
    where, slash, db_text = rest.partition("/")
    db = 0
    if slash:
        if cluster:
            raise bad("names a database, but a cluster has only database 0")
        if not db_text.isdigit():
            raise bad(f"has a database {db_text!r} that is not a number")
        db = int(db_text)
    nodes = []
    for part in where.split(",") if cluster else [where]:
        hp = _HOST_PORT.match(part)
        port = int(hp.group(2) or 6379) if hp else 0
        if not hp or not 0 < port < 65536:
            raise bad(f"has a bad HOST:PORT {part!r}")
        nodes.append((hp.group(1).strip("[]"), port))
    return RemoteTarget(scheme, tuple(nodes), cluster, db, username)


def parse_ca_file(key: str, value: Any) -> str:
    path = parse_str(key, value)
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise KVBMConfigError(
            f"{key}: {path!r} is not a file; set it to the PEM file of the CA that signed the "
            f"Redis/Valkey server's certificate, or remove it to use the system's CAs")
    if not os.access(os.path.expanduser(path), os.R_OK):
        raise KVBMConfigError(f"{key}: {path!r} is not readable by this process")
    return os.path.abspath(os.path.expanduser(path))


def check_remote_tls(kwargs: dict, sources: dict) -> None:
    """A CA file needs a TLS remote_url (``kwargs``: the parsed fields)."""
    url = kwargs.get("remote_url")
    if kwargs.get("remote_tls_ca_file") is not None and not (
            url is not None and parse_remote_url("remote_url", url).tls):
        source = sources["remote_tls_ca_file"]
        if source != "remote_tls_ca_file":
            source += " (sets remote_tls_ca_file)"
        raise KVBMConfigError(
            f"{source}: it only applies to a TLS remote_url (rediss://, valkeys://, "
            f"...+cluster://), not {url!r}; use one or remove it")
