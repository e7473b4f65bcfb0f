"""The shared page pool as the scheduler sees it: the slot table, mapped read-only.

A page is in the pool if every TP rank's pool file holds its key in the
key's set (layout.py): memory reads of the mapped table, no lock, no file
I/O, so this may even run on vLLM's scheduler thread (it runs on the lookup
thread like every view). The files are the workers' (or the kvbm-pool
process's): until a rank's file exists every page is a miss; a file retired
or replaced (an engine with another KV layout took the name, a restart
after a crash) is mapped again, checked at most once a second.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.base import TierView
from vllm_kvbm.tiers.page_names import PageNames
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.pool_file import MappedTable, map_table

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

# How often a mapped file's path is checked for another file behind it.
_RECHECK_S = 1.0


class _RankFile:
    def __init__(self, path: str, digest: bytes):
        self.path, self.digest = path, digest
        self.table: MappedTable | None = None
        self.checked = -1e9

    def current(self) -> MappedTable | None:
        """The live table at ``path`` (mapped again when it changed)."""
        now = time.monotonic()
        table = self.table
        if table is not None and table.retired:
            table = None
        if table is not None and now - self.checked < _RECHECK_S:
            return table
        if table is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == table.inode:
                    self.checked = now
                    return table
            except OSError:
                pass
        if self.table is not None:
            self.table.close()
        self.table, self.checked = map_table(self.path, self.digest), now
        return self.table


class PoolView(TierView):
    name = "pool"

    def __init__(
        self,
        directory: str,
        namespace: str,
        page_bytes: int,
        world_size: int,
        secret: bytes | None = None,
    ):
        self._names = PageNames(namespace, page_bytes, secret)
        directory = os.path.abspath(directory)
        self._files = []
        for rank in range(world_size):
            digest = layout.name_digest(namespace, page_bytes, rank, world_size)
            self._files.append(
                _RankFile(
                    os.path.join(directory, layout.file_name(digest, rank, world_size)), digest
                )
            )

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", secret: bytes | None
    ) -> "PoolView":
        config.pool_slots(info.page_bytes)  # fails early if too small
        return cls(
            config.pool_dir,
            info.tier_namespace,
            info.page_bytes,
            info.key_namespace.tp_size,
            secret,
        )

    def contains(self, key: PageKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[PageKey]) -> list[bool]:
        tables = [f.current() for f in self._files]
        if any(t is None for t in tables):
            return [False] * len(keys)
        found = []
        for key in keys:
            tkey = layout.table_key(self._names, key)
            found.append(
                all(layout.find(t.buf, t.superblock.geometry, tkey) is not None for t in tables)
            )
        return found

    def close(self) -> None:
        for f in self._files:
            if f.table is not None:
                f.table.close()
                f.table = None
