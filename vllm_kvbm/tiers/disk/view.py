"""The disk tier as the scheduler sees it: a page exists if its file does."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.base import TierView
from vllm_kvbm.tiers.page_format import disk_page_namer

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo


class DiskView(TierView):
    """The worker's store writes files atomically and LMCache's LRU deletes
    them, so the directory itself is the index: it is exact across engine
    restarts and needs no messages between the processes.
    """

    name = "disk"

    def __init__(self, directory: str, namespace: str, page_bytes: int, world_size: int,
                 secret: bytes | None = None):
        # ``secret``: the page secret, which keys the pages' names (page_format).
        self._paths = [
            disk_page_namer(directory, namespace, page_bytes, rank, world_size, secret)
            for rank in range(world_size)]

    @classmethod
    def from_config(cls, config: "KVBMConfig", info: "EngineInfo",
                    secret: bytes | None) -> "DiskView":
        config.disk_blocks(info.page_bytes)  # fails early if too small
        return cls(config.disk_cache_dir, info.tier_namespace, info.page_bytes,
                   info.key_namespace.tp_size, secret)

    def contains(self, key: PageKey) -> bool:
        return all(os.path.exists(path(key)) for path in self._paths)
