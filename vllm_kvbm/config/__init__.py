"""The one place where KVBM's configuration is read and validated.

Sources: defaults, ``kv_connector_extra_config`` from ``--kv-transfer-config``
and environment variables (``KVBM_*``; Dynamo's ``DYN_KVBM_*`` names are
accepted where the meaning is the same). A key that two sources set to
different values is an error naming both (the same value twice is logged);
``KVBMConfig.describe()`` lists every value a source set, with its source.
Every error names the key and says how to fix it, and is raised when the
engine starts.

One module per concern: errors (KVBMConfigError), versions (the vLLM version
gate), parsing (single values), urls (remote tier URLs, TLS), secrets (the one
Secret class: remote password, page secret), dynamo (DYN_KVBM_* variables);
this module holds KVBMConfig, the one validated object, and load_config.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from vllm_kvbm.config.dynamo import DYN_ENV, apply_dyn_metrics, dynamo_env_not_read
from vllm_kvbm.config.env_names import misspelt_env
from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.config.parsing import (
    parse_bool,
    parse_choice,
    parse_dir,
    parse_host,
    parse_int,
    parse_nixl_backend,
    parse_port,
    parse_seconds,
    parse_size,
    parse_socket_path,
    parse_str,
)
from vllm_kvbm.config.secrets import (
    MIN_PAGE_SECRET_BYTES,
    Secret,
    page_secret_env,
    parse_page_secret_file,
    parse_password_file,
    remote_password_env,
)
from vllm_kvbm.config.urls import (
    RemoteTarget,
    check_directory_url,
    check_remote_tls,
    check_remote_url,
    parse_ca_file,
    parse_lm_url,
    parse_remote_url,
)
from vllm_kvbm.config.versions import SUPPORTED_VLLM, check_vllm_version, vllm_release

# What callers import from vllm_kvbm.config; the rest lives in the concern's module.
__all__ = [
    "DEFAULT_TIER_READ_TIMEOUT_S",
    "DEFAULT_TIER_WRITE_QUEUE_PAGES",
    "KVBMConfig",
    "KVBMConfigError",
    "MIN_PAGE_SECRET_BYTES",
    "RemoteTarget",
    "SUPPORTED_VLLM",
    "Secret",
    "check_vllm_version",
    "config_keys",
    "disk_tier_too_small",
    "load_config",
    "parse_lm_url",
    "parse_remote_url",
    "parse_size",
    "vllm_release",
]

logger = logging.getLogger(__name__)

DEFAULT_TIER_WRITE_QUEUE_PAGES = 64
DEFAULT_TIER_READ_TIMEOUT_S = 10.0
HOST_COPY_PATHS = ("AUTO", "NIXL", "THREADS")  # host_copy_path, as parse_choice reads it


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
    # counted (kvbm_tier_write_dropped_pages_total). Each holds a copy of one KV block
    # in RAM until written: this bounds that memory when a tier is slower
    # than the offload rate.
    tier_write_queue_pages: int = DEFAULT_TIER_WRITE_QUEUE_PAGES
    # A lower-tier fetch that reads none of its pages for this long fails
    # (vLLM recomputes them): a frozen filesystem or a hung read costs a
    # hit, never a request that waits forever.
    tier_read_timeout_s: float = DEFAULT_TIER_READ_TIMEOUT_S
    # Shared page pool (tiers/pool/): pages in a file in memory per worker,
    # in pool_dir, that outlives the engine and is shared by the engines of
    # one model on the machine and read by peers (None: no pool tier).
    pool_cache_bytes: int | None = None
    pool_dir: str = "/dev/shm"
    # The kvbm-pool process's Unix socket: it keeps the pool files (and serves
    # them to peers) while engines restart. None: each worker keeps its own.
    pool_socket: str | None = None
    # Serve this engine's pool to peers: the control endpoint's port for TP
    # rank 0 (rank r: port + r), bound on pool_serve_host. None: not served.
    pool_serve_port: int | None = None
    pool_serve_host: str = "0.0.0.0"
    # Read pages from other engines' pools (the peer tier) for requests
    # whose kv_transfer_params name the peer (a router's hint).
    peer_reads: bool = False
    # Bound on one batch of reads from a peer's pool; past it: recomputed.
    peer_read_timeout_s: float = 2.0
    # Which peer's pool holds which page, for requests without a router's
    # hint (tiers/peer/directory.py): a Redis/Valkey server (its password is
    # the remote tier's). Engines serving their pool write it, peer_reads
    # engines read it. None: no directory.
    peer_directory_url: str | None = None
    # A directory entry lives this long unless its holder writes it again.
    peer_directory_ttl_s: float = 300.0
    # Password of a redis:// / valkey:// remote tier (requirepass or the ACL
    # user's), from remote_password_file or KVBM_REMOTE_PASSWORD. Never logged.
    remote_password: Secret | None = field(default=None, repr=False)
    # CA certificates (PEM) a rediss:// / valkeys:// server's certificate must
    # chain to; None: the system's CAs.
    remote_tls_ca_file: str | None = None
    # Serve the kvbm_* metrics on their own HTTP port from the engine process
    # (offline LLM use, where there is no vllm serve /metrics). None: off.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # a metrics port is for this machine unless opened
    # NIXL backend moving pages between the engine's KV cache and the host tier.
    nixl_backend: str = "UCX"
    # CPU build: "auto" measures NIXL's copies and plain threaded copies at
    # startup and keeps the faster; "nixl" or "threads" fixes the path.
    host_copy_path: str = "auto"
    # Extra text mixed into every block key: engines that must never share
    # cached KV (e.g. different fine-tunes under one name) set different ones.
    namespace: str = ""
    # Load only the part of a found prefix whose load is expected to beat
    # recomputing it (costs learned as the engine runs); off: load all found.
    load_split: bool = True
    # Keys the MAC of every disk/remote page (page_secret_file or
    # KVBM_PAGE_SECRET); None: pages carry no MAC. Never in repr or logs.
    page_secret: Secret | None = field(default=None, repr=False)
    # key -> where its value came from ("kv_connector_extra_config", an env
    # var, or both when they agree); for describe(), not part of the value.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        """Every value a source set, with that source; secrets show as <set>."""
        items = [
            f"{key}={_shown(key, getattr(self, name))} from {self.sources[key]}"
            for key, (name, _) in sorted(_KEYS.items())
            if key in self.sources
        ]
        for key, secret in (
            ("page_secret", self.page_secret),
            ("remote_password", self.remote_password),
        ):
            if secret is not None and f"{key}_file" not in self.sources:
                items.append(f"{key}=<set> from {secret.source}")
        return "; ".join(items) if items else "every key at its default"

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

    def pool_slots(self, page_bytes: int) -> int:
        """Pages the pool file holds per worker (0 when there is no pool tier)."""
        if self.pool_cache_bytes is None:
            return 0
        from vllm_kvbm.tiers.page_format import HEADER_BYTES
        from vllm_kvbm.tiers.pool.layout import Geometry

        geometry = Geometry.for_capacity(self.pool_cache_bytes, HEADER_BYTES + page_bytes)
        if geometry is None:
            from vllm_kvbm.tiers.pool.pool_file import pool_too_small

            raise pool_too_small(self.pool_cache_bytes, HEADER_BYTES + page_bytes)
        return geometry.nslots

    def host_slots(self, page_bytes: int, page_blocks: int = 1) -> int:
        """Number of whole pages the host tier holds; at least one or an error."""
        if self.host_cache_blocks is not None:
            slots = self.host_cache_blocks // page_blocks
            if slots < 1:
                raise KVBMConfigError(
                    f"host_cache_blocks: {self.host_cache_blocks} blocks cannot hold one page "
                    f"of {page_blocks} blocks (page_tokens); set host_cache_blocks to at "
                    f"least {page_blocks}, or a smaller page_tokens"
                )
            return slots
        slots = self.host_cache_bytes // page_bytes
        if slots < 1:
            raise KVBMConfigError(
                f"host_cache_size: {self.host_cache_bytes} bytes cannot hold one KV page "
                f"of this model ({page_bytes} bytes = all layers of "
                f"{'one block' if page_blocks == 1 else f'{page_blocks} blocks (page_tokens)'}"
                f"); set host_cache_size to at least {page_bytes} bytes "
                f'(e.g. "{max(1, -(-page_bytes * 64 // 1024**2))}MiB" for 64 pages)'
            )
        return slots

    def engine_totals(self, host_slots: int, page_bytes: int, workers: int) -> str:
        """What the whole engine takes: each worker (TP rank) has its own host
        pool and disk capacity, so the sizes configured count once per worker."""
        host = host_slots * page_bytes
        text = (
            f"host tier {_gib(host)} per worker x {workers} worker(s) = "
            f"{_gib(host * workers)} of host RAM"
        )
        if self.pool_cache_bytes is not None:
            text += (
                f"; pool tier {_gib(self.pool_cache_bytes)} per worker x {workers} = "
                f"up to {_gib(self.pool_cache_bytes * workers)} of memory in "
                f"{self.pool_dir}"
            )
        if self.disk_cache_dir is not None:
            text += (
                f"; disk tier {_gib(self.disk_cache_bytes)} per worker x {workers} = "
                f"up to {_gib(self.disk_cache_bytes * workers)} in {self.disk_cache_dir}"
            )
        # The workers' staging rows for streamed loads come on top of the host
        # tier; their size is the worker's (its startup line gives its pool).
        return text + (
            " (host_cache_size and disk_cache_size are per worker; each worker "
            "also holds a few pages of staging for streamed loads)"
        )


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _shown(key: str, value: Any) -> str:
    """A parsed value as the startup line and conflict errors show it: never a
    secret, sizes in bytes and GiB."""
    if isinstance(value, Secret):
        return "<set>"
    if key in ("host_cache_size", "disk_cache_size", "pool_cache_size"):
        return f"{value} bytes ({_gib(value)})"
    return repr(value) if isinstance(value, str) else str(value)


def disk_tier_too_small(capacity_bytes: int, page_bytes: int) -> KVBMConfigError:
    """The one message for a disk tier that cannot hold a page (scheduler and worker)."""
    return KVBMConfigError(
        f"disk_cache_size: {capacity_bytes} bytes cannot hold one KV page of this model "
        f"({page_bytes} bytes with its header); set disk_cache_size to at least "
        f"{page_bytes} bytes"
    )


# extra_config key -> (field name, parser)
_KEYS = {
    "host_cache_size": ("host_cache_bytes", parse_size),
    "host_cache_blocks": ("host_cache_blocks", lambda k, v: parse_int(k, v, 1)),
    "page_tokens": ("page_tokens", lambda k, v: parse_int(k, v, 1)),
    "offload_decode_blocks": ("offload_decode_blocks", parse_bool),
    "disk_cache_dir": ("disk_cache_dir", parse_dir),
    "disk_cache_size": ("disk_cache_bytes", parse_size),
    "disk_admission": (
        "disk_admission",
        lambda k, v: parse_choice(k, v, ("ALWAYS", "FREQUENCY")).lower(),
    ),
    "disk_admission_min_uses": ("disk_admission_min_uses", lambda k, v: parse_int(k, v, 1)),
    "remote_url": ("remote_url", check_remote_url),
    "remote_timeout_s": ("remote_timeout_s", parse_seconds),
    "tier_write_queue_pages": ("tier_write_queue_pages", lambda k, v: parse_int(k, v, 1)),
    "tier_read_timeout_s": ("tier_read_timeout_s", parse_seconds),
    "pool_cache_size": ("pool_cache_bytes", parse_size),
    "pool_dir": ("pool_dir", parse_dir),
    "pool_socket": ("pool_socket", parse_socket_path),
    "pool_serve_port": ("pool_serve_port", parse_port),
    "pool_serve_host": ("pool_serve_host", parse_host),
    "peer_reads": ("peer_reads", parse_bool),
    "peer_read_timeout_s": ("peer_read_timeout_s", parse_seconds),
    "peer_directory_url": ("peer_directory_url", check_directory_url),
    "peer_directory_ttl_s": ("peer_directory_ttl_s", parse_seconds),
    "remote_password_file": ("remote_password", parse_password_file),
    "remote_tls_ca_file": ("remote_tls_ca_file", parse_ca_file),
    "metrics_port": ("metrics_port", parse_port),
    "metrics_host": ("metrics_host", parse_host),
    "nixl_backend": ("nixl_backend", parse_nixl_backend),
    "host_copy_path": ("host_copy_path", lambda k, v: parse_choice(k, v, HOST_COPY_PATHS).lower()),
    "namespace": ("namespace", parse_str),
    "page_secret_file": ("page_secret", parse_page_secret_file),
    "load_split": ("load_split", parse_bool),
}

# env var -> (extra_config key, converter of the env text into that key's value);
# every key has KVBM_<KEY>; Dynamo's DYN_KVBM_* names are in dynamo.py.
_ENV = {
    "KVBM_HOST_CACHE_SIZE": ("host_cache_size", str),
    "KVBM_HOST_CACHE_GB": ("host_cache_size", lambda v: f"{v}GB"),
    "KVBM_HOST_CACHE_BLOCKS": ("host_cache_blocks", str),
    "KVBM_OFFLOAD_DECODE_BLOCKS": ("offload_decode_blocks", str),
    "KVBM_PAGE_TOKENS": ("page_tokens", str),
    "KVBM_DISK_CACHE_DIR": ("disk_cache_dir", str),
    "KVBM_DISK_CACHE_SIZE": ("disk_cache_size", str),
    "KVBM_DISK_CACHE_GB": ("disk_cache_size", lambda v: f"{v}GB"),
    "KVBM_DISK_ADMISSION": ("disk_admission", str),
    "KVBM_DISK_ADMISSION_MIN_USES": ("disk_admission_min_uses", str),
    "KVBM_REMOTE_URL": ("remote_url", str),
    "KVBM_REMOTE_TIMEOUT_S": ("remote_timeout_s", str),
    "KVBM_TIER_WRITE_QUEUE_PAGES": ("tier_write_queue_pages", str),
    "KVBM_TIER_READ_TIMEOUT_S": ("tier_read_timeout_s", str),
    "KVBM_POOL_CACHE_SIZE": ("pool_cache_size", str),
    "KVBM_POOL_DIR": ("pool_dir", str),
    "KVBM_POOL_SOCKET": ("pool_socket", str),
    "KVBM_POOL_SERVE_PORT": ("pool_serve_port", str),
    "KVBM_POOL_SERVE_HOST": ("pool_serve_host", str),
    "KVBM_PEER_READS": ("peer_reads", str),
    "KVBM_PEER_READ_TIMEOUT_S": ("peer_read_timeout_s", str),
    "KVBM_PEER_DIRECTORY_URL": ("peer_directory_url", str),
    "KVBM_PEER_DIRECTORY_TTL_S": ("peer_directory_ttl_s", str),
    "KVBM_REMOTE_PASSWORD_FILE": ("remote_password_file", str),
    "KVBM_REMOTE_TLS_CA_FILE": ("remote_tls_ca_file", str),
    "KVBM_METRICS_PORT": ("metrics_port", str),
    "KVBM_METRICS_HOST": ("metrics_host", str),
    "KVBM_NIXL_BACKEND": ("nixl_backend", str),
    "KVBM_HOST_COPY_PATH": ("host_copy_path", str),
    "KVBM_NAMESPACE": ("namespace", str),
    "KVBM_PAGE_SECRET_FILE": ("page_secret_file", str),
    "KVBM_LOAD_SPLIT": ("load_split", str),
    **DYN_ENV,
}


def load_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> KVBMConfig:
    """Builds the validated config from ``kv_connector_extra_config`` and env.
    A key two sources set to different values is an error naming both."""
    environ = os.environ if environ is None else environ
    extra = dict(extra or {})
    unknown = [k for k in extra if k not in _KEYS]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(key, _KEYS, n=1)
        raise KVBMConfigError(
            f"kv_connector_extra_config: unknown key {key!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" Valid keys: {', '.join(sorted(_KEYS))}"
        )
    given: dict[str, list[tuple[str, Any]]] = {}  # key -> [(source, raw value)]
    for key, raw in extra.items():
        given[key] = [(key, raw)]
    for env, (key, convert) in _ENV.items():
        if env in environ and environ[env].strip():
            given.setdefault(key, []).append((env, convert(environ[env].strip())))
    apply_dyn_metrics(environ, given)
    ignored = dynamo_env_not_read(environ)
    if ignored:  # names only: some of Dynamo's hold credentials
        logger.warning(
            "KVBM: %s %s Dynamo's and not read by vllm_kvbm (no KVBM setting means "
            "the same; docs/configuration.md, Dynamo's variables)",
            ", ".join(ignored),
            "is" if len(ignored) == 1 else "are",
        )
    for line in misspelt_env(environ, [*_ENV, "KVBM_REMOTE_PASSWORD", "KVBM_PAGE_SECRET"]):
        logger.warning("KVBM: %s", line)
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}  # key -> its first source (the key itself: extra_config)
    shown: dict[str, str] = {}  # key -> its sources, as describe() names them
    for key, pairs in given.items():
        field_name = _KEYS[key][0]
        parsed = [(source, raw, _parse(key, source, raw)) for source, raw in pairs]
        first, _, value = parsed[0]
        names = [_source_name(key, source) for source, _, _ in parsed]
        for (_, raw, other), name in zip(parsed[1:], names[1:]):
            if other != value:  # a secret's file is named by its path, never its content
                this, that = (
                    (repr(pairs[0][1]), repr(raw))
                    if isinstance(value, Secret)
                    else (_shown(key, value), _shown(key, other))
                )
                raise KVBMConfigError(
                    f"{key} is set to two different values: {this} by {names[0]} and "
                    f"{that} by {name}; set it in one place only"
                )
        if len(parsed) > 1:
            logger.info("KVBM: %s is set to the same value by %s", key, " and ".join(names))
        kwargs[field_name], sources[key], shown[key] = value, first, " and ".join(names)
    if "host_cache_blocks" in shown and "host_cache_size" in shown:
        raise KVBMConfigError(
            f"host_cache_blocks (from {shown['host_cache_blocks']}) and host_cache_size (from "
            f"{shown['host_cache_size']}) both size the host tier; set only one of them"
        )
    _check_pool(shown)
    _check_directory(kwargs, shown)
    page_secret_env(environ, kwargs, sources)
    remote_password_env(environ, kwargs, sources)
    check_remote_tls(kwargs, sources)
    return KVBMConfig(**kwargs, sources=shown)


def _check_pool(shown: dict[str, str]) -> None:
    """The pool's other keys mean nothing without a pool: an error, not a
    setting silently ignored."""
    if "pool_cache_size" in shown:
        return
    for key in ("pool_dir", "pool_socket", "pool_serve_port", "pool_serve_host"):
        if key in shown:
            raise KVBMConfigError(
                f"{key} (from {shown[key]}) is set but pool_cache_size is not: the pool tier "
                f'is off; set pool_cache_size (e.g. "8GiB" per worker) to use it, or '
                f"remove {key}"
            )


def _check_directory(kwargs: dict, shown: dict[str, str]) -> None:
    """The directory needs an engine that reads it (peer_reads) or writes
    it (a pool served to peers); its TTL needs the directory."""
    if "peer_directory_url" not in shown:
        if "peer_directory_ttl_s" in shown:
            raise KVBMConfigError(
                f"peer_directory_ttl_s (from {shown['peer_directory_ttl_s']}) is set but "
                f"peer_directory_url is not; set peer_directory_url (redis://HOST:PORT) or "
                f"remove peer_directory_ttl_s"
            )
        return
    if not (kwargs.get("peer_reads") or "pool_serve_port" in shown or "pool_socket" in shown):
        raise KVBMConfigError(
            f"peer_directory_url (from {shown['peer_directory_url']}) is set, but this engine "
            f"neither reads peers' pools (peer_reads) nor serves its own pool to peers "
            f"(pool_serve_port, or pool_socket with kvbm-pool --serve-port); set one of them, "
            f"or remove peer_directory_url"
        )
    ttl = kwargs.get("peer_directory_ttl_s", KVBMConfig.peer_directory_ttl_s)
    if ttl < MIN_DIRECTORY_TTL_S:
        raise KVBMConfigError(
            f"peer_directory_ttl_s: {ttl:g} s is shorter than {MIN_DIRECTORY_TTL_S:g} s (the "
            f"holder refreshes its entries every third of it); set it to a few minutes, e.g. "
            f"300"
        )


# The shortest directory entry TTL: entries are refreshed every third of it.
MIN_DIRECTORY_TTL_S = 3.0


def _parse(key: str, source: str, raw: Any) -> Any:
    """``raw`` through ``key``'s parser; an error names the env var it came from."""
    try:
        return _KEYS[key][1](key, raw)
    except KVBMConfigError as err:
        if source != key:
            raise KVBMConfigError(f"{source} (sets {err})") from None
        raise


def _source_name(key: str, source: str) -> str:
    return "kv_connector_extra_config" if source == key else source


def config_keys() -> list[str]:
    return sorted(_KEYS)


assert {f.name for f in fields(KVBMConfig)} >= {v[0] for v in _KEYS.values()}
