"""What the LMCache-backed stores share: LMCache imports, keys, metadata, an event loop.

LMCache's backends run their I/O as coroutines on an asyncio loop the caller
provides; each store runs one on a daemon thread of its own.
"""

from __future__ import annotations

import asyncio
import os
import threading

import torch

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm.tiers.base import TierStore
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.page_format import HEADER_BYTES, disk_page_bytes

# LMCache sizes its memory and disk in GiB (floats)
GIB = 1024**3


def start_loop(name: str):
    loop = asyncio.new_event_loop()

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()
            except Exception:  # noqa: BLE001
                pass

    thread = widened_thread(run, name)  # the tier's network I/O: not the worker's core
    thread.start()
    return loop, thread


def stop_loop(loop, thread, wait_s: float) -> bool:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # already closed
        pass
    thread.join(wait_s)
    return not thread.is_alive()


def _keep_multiproc_env() -> None:
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        os.makedirs(directory, exist_ok=True)


def lmcache_api():
    """Imports LMCache lazily (it is slow to import and not needed without tiers)."""
    import lmcache.utils
    from lmcache.utils import CacheEngineKey, parse_cache_key
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    # LMCache 0.5.6 guards its metrics with one global, non-reentrant lock,
    # and a MemoryObj that the garbage collector frees takes that lock in
    # __del__. A collection that runs while the lock is held (e.g. inside
    # LocalCPUBackend's metric setup when a store reconnects, with staging
    # memory of a dropped connection still unreferenced) then deadlocks that
    # thread forever: seen here as a remote store's reconnect never
    # returning. The lock only serialises metric updates, so a reentrant
    # one is safe.
    if not isinstance(lmcache.utils._shared_observability_lock, type(threading.RLock())):
        lmcache.utils._shared_observability_lock = threading.RLock()
    # LMCache's metrics logger sets PROMETHEUS_MULTIPROC_DIR to a fixed
    # /tmp/lmcache_prometheus in this process's environment when it is unset.
    # Every process started from here on (a `vllm serve`, an engine of the
    # offline LLM class) then shares that never-wiped directory, and vLLM
    # sums its counters with those of every earlier process. Where vLLM set
    # the variable (vllm serve), it is left alone.
    from lmcache.observability import PrometheusLogger

    PrometheusLogger._ensure_multiprocess_dir = staticmethod(_keep_multiproc_env)
    return CacheEngineKey, parse_cache_key, LMCacheEngineConfig, MemoryFormat, LMCacheMetadata


class LMCacheStore(TierStore):
    """A store whose pages live in an LMCache backend under our page format."""

    def __init__(
        self,
        page_bytes: int,
        namespace: str,
        rank: int,
        world_size: int,
        page_secret: bytes | None = None,
        layout: str = "",
    ):
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        (
            self._CacheEngineKey,
            self._parse_cache_key,
            self._Config,
            MemoryFormat,
            LMCacheMetadata,
        ) = lmcache_api()
        self._fmt = MemoryFormat.KV_2LTD  # any non-binary format; arena-backed
        self._codec = PageCodec(
            namespace, page_bytes, page_secret, rank=rank, world_size=world_size, layout=layout
        )
        self.page_bytes = page_bytes
        self._rank, self._world_size = rank, world_size
        self._model = self._codec.model_name
        n = self._codec.stored_bytes
        self._shape = torch.Size([1, 1, 1, n])  # 4-D: close() needs it
        self._tomb_shape = torch.Size([1, 1, 1, HEADER_BYTES])
        self._phys = disk_page_bytes(page_bytes)  # allocator/disk accounting unit
        self._md = LMCacheMetadata(
            model_name=self._model,
            world_size=world_size,
            local_world_size=world_size,
            worker_id=rank,
            local_worker_id=rank,
            kv_dtype=torch.uint8,
            kv_shape=(1, 1, 1, 1, n),
            chunk_size=1,
        )

    def _ckey(self, key: bytes):
        return self._ckey_of(self._codec.chunk_hash(key))

    def _ckey_of(self, chunk_hash: int):
        """LMCache's key of the page named by ``chunk_hash`` (the page key
        itself, or its keyed hash under a page secret: page_names.PageNames)."""
        return self._CacheEngineKey(
            self._model, self._world_size, self._rank, chunk_hash, torch.uint8
        )
