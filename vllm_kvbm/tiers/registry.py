"""Which store (worker side) and view (scheduler side) serve each configured tier.

One line per medium: the shared page pool (``pool_cache_size``), the disk
directory (``disk_cache_dir``) and each
``remote_url`` scheme config accepts (config's ``parse_remote_url``) name a
medium's folder. Classes are imported only when a tier is opened, so the
scheduler importing a view never imports its store (LMCache, NIXL).
Adding a medium: its folder (store.py with a TierStore, view.py with a
TierView, each with ``from_config``) and a line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.config import parse_remote_url

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.tiers.base import TierStore, TierView


@dataclass(frozen=True)
class Medium:
    """A medium's view and store as ``module:Class``, imported when opened."""

    view: str
    store: str

    def view_class(self) -> type:
        return _load(self.view)

    def store_class(self) -> type:
        return _load(self.store)


POOL = Medium("vllm_kvbm.tiers.pool.view:PoolView", "vllm_kvbm.tiers.pool.store:PoolStore")
DISK = Medium("vllm_kvbm.tiers.disk.view:DiskView", "vllm_kvbm.tiers.disk.store:DiskStore")
# Other engines' pools: read on a router's hint (peer_reads), never written.
PEER = Medium("vllm_kvbm.tiers.peer.view:PeerView", "vllm_kvbm.tiers.peer.store:PeerStore")
_LM = Medium("vllm_kvbm.tiers.lm.view:RemoteView", "vllm_kvbm.tiers.lm.store:RemoteStore")
_REDIS = Medium("vllm_kvbm.tiers.redis.view:RedisView", "vllm_kvbm.tiers.redis.store:RedisStore")

# remote_url's scheme (``+cluster`` is part of the URL, not of the scheme).
REMOTE: dict[str, Medium] = {
    "lm": _LM,
    "redis": _REDIS,
    "rediss": _REDIS,
    "valkey": _REDIS,
    "valkeys": _REDIS,
}


def configured(config: "KVBMConfig") -> list[Medium]:
    """The media of the configured lower tiers, in lookup order (the pool in
    memory, then disk, then remote)."""
    media = []
    if config.pool_cache_bytes is not None:
        media.append(POOL)
    if config.disk_cache_dir is not None:
        media.append(DISK)
    if config.remote_url is not None:
        scheme = parse_remote_url("remote_url", config.remote_url).scheme
        if scheme not in REMOTE:  # config accepted a scheme no medium serves
            raise ValueError(
                f"remote_url: no tier registered for {scheme}:// "
                f"(vllm_kvbm/tiers/registry.py REMOTE)"
            )
        media.append(REMOTE[scheme])
    return media


def page_secret(config: "KVBMConfig") -> bytes | None:
    """The page secret, which keys the pages' names and seals them
    (page_names, page_seal); the scheduler's views and the workers' stores
    use the same one."""
    return config.page_secret.reveal() if config.page_secret is not None else None


def open_views(config: "KVBMConfig", info: "EngineInfo") -> list["TierView"]:
    """The scheduler's views of the configured lower tiers."""
    secret = page_secret(config)
    return [m.view_class().from_config(config, info, secret) for m in configured(config)]


def open_peer_view(config: "KVBMConfig", info: "EngineInfo"):
    """The scheduler's view of peers' pools (None: peer_reads off). Not one of
    open_views': it answers only for a request whose hint names the peer, or,
    with peer_directory_url, the peer the directory names."""
    if not config.peer_reads:
        return None
    return PEER.view_class().from_config(config, info, page_secret(config))


def open_stores(
    config: "KVBMConfig", info: "EngineInfo", rank: int, layout: str = ""
) -> list["TierStore"]:
    """This worker's stores of the configured lower tiers, and its reader of
    peers' pools with peer_reads. ``layout``: layout_fingerprint of this
    worker's KV cache ("" where unknown)."""
    secret = page_secret(config)
    media = configured(config) + ([PEER] if config.peer_reads else [])
    return [m.store_class().from_config(config, info, rank, secret, layout) for m in media]


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
