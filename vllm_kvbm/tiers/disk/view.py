"""The disk tier as the scheduler sees it: a page exists if its file does."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.base import TierView
from vllm_kvbm.tiers.page_names import disk_page_namer

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


def replica_directory(directory: str, data_parallel_index: int) -> str:
    """Where a data-parallel rank keeps its disk pages: rank 0 (and an engine
    without DP) in ``directory``, rank r in ``directory/dp<r>``. Each rank's
    store has an index and an LRU of its own, which cannot see another
    process's writes and evictions: on one directory two ranks would count
    the same files twice, delete each other's pages and, at startup, each
    other's writes in progress. So DP ranks share no disk pages."""
    if data_parallel_index == 0:
        return directory
    return os.path.join(directory, f"dp{data_parallel_index}")


class DiskView(TierView):
    """The worker's store writes files atomically and LMCache's LRU deletes
    them, so the directory itself is the index: it is exact across engine
    restarts and needs no messages between the processes.
    """

    name = "disk"

    def __init__(
        self,
        directory: str,
        namespace: str,
        page_bytes: int,
        world_size: int,
        secret: bytes | None = None,
    ):
        # ``secret``: the page secret, which keys the pages' names (page_names).
        self._paths = [
            disk_page_namer(directory, namespace, page_bytes, rank, world_size, secret)
            for rank in range(world_size)
        ]

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", secret: bytes | None
    ) -> "DiskView":
        config.disk_blocks(info.page_bytes)  # fails early if too small
        directory = replica_directory(config.disk_cache_dir, info.data_parallel_index)
        if info.data_parallel_index:
            logger.info(
                "KVBM: data-parallel rank %d keeps its disk tier in %s (each DP rank "
                "a directory of its own; rank 0 uses disk_cache_dir itself)",
                info.data_parallel_index,
                directory,
            )
        return cls(
            directory, info.tier_namespace, info.page_bytes, info.key_namespace.tp_size, secret
        )

    def contains(self, key: PageKey) -> bool:
        return all(os.path.exists(path(key)) for path in self._paths)
