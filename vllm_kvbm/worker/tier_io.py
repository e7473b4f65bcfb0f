"""The lower tiers' I/O, off the engine thread: fetches into host slots and spills.

Each tier (disk, remote) gets one I/O thread, so a slow remote never delays
a disk read and the engine thread never blocks on a tier. A load whose pages
live below the host tier is fetched into its host slots here first; the
worker then moves the whole job with one NIXL read.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.config import parse_remote_url
from vllm_kvbm.tiers.page_format import copy_bytes

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.messages import KVBMWorkerMetadata, SpillJob, TransferJob
    from vllm_kvbm.tiers.base import TierStore

logger = logging.getLogger(__name__)


class TierIO:
    def __init__(self) -> None:
        self.tiers: dict[str, TierStore] = {}
        self._io: dict[str, ThreadPoolExecutor] = {}
        self._fetching: list[tuple[TransferJob, Future]] = []
        self._writing: list[tuple[str, bytes, Future]] = []

    def add(self, store: "TierStore") -> None:
        self.tiers[store.name] = store
        self._io[store.name] = ThreadPoolExecutor(1, thread_name_prefix=f"kvbm-{store.name}")

    def fetch(self, job: "TransferJob", host_pool: torch.Tensor) -> None:
        """Starts reading ``job.fetch``'s pages into their host slots."""
        by_tier: dict[str, list[tuple[int, bytes]]] = {}
        for i, tier, key in job.fetch:
            by_tier.setdefault(tier, []).append((i, key))
        # One future per tier, combined: the job is ready when all are.
        futures = []
        for tier, items in by_tier.items():
            store = self.tiers.get(tier)

            def fetch(store=store, tier=tier, items=items):
                results = []
                for i, key in items:
                    try:
                        status = store.get_into(key, host_pool[job.slots[i]])
                    except Exception as err:  # a store must not take the engine down
                        logger.warning("KVBM: %s read failed: %s", tier, err)
                        status = "error"
                    results.append((tier, key, status))
                return results
            futures.append(self._io[tier].submit(fetch) if store is not None
                           else _done([(tier, key, "error") for _, key in items]))
        self._fetching.append((job, _gather(futures)))

    def spill(self, spill: "SpillJob", slot_page: torch.Tensor) -> None:
        """Copies a host slot now (so it can be reused at once) and writes it
        to ``spill.tiers`` in the background."""
        # Stream order: host memory only. The slot is spilled after every
        # worker reported its store done (its fence passed, NIXL finished the
        # copy into host RAM) and stays pinned until this copy is reported.
        page = torch.empty_like(slot_page)
        copy_bytes(page, slot_page)
        for tier in spill.tiers:
            store = self.tiers.get(tier)
            if store is not None:
                self._writing.append(
                    (tier, spill.key, self._io[tier].submit(store.put, spill.key, page)))

    def poll(self, meta: "KVBMWorkerMetadata") -> list[tuple["TransferJob", bool]]:
        """Records finished fetches and writes in ``meta``; returns the fetched
        load jobs, each with whether every page arrived intact."""
        ready, still = [], []
        for job, future in self._fetching:
            if not future.done():
                still.append((job, future))
                continue
            results = future.result()
            bad = [(tier, key, status) for tier, key, status in results if status != "ok"]
            for tier, _, status in results:
                meta.tier_events[(tier, status)] += 1
            if bad:
                logger.warning("KVBM: %d of %d lower-tier pages for %s unusable (%s); "
                               "vLLM recomputes them", len(bad), len(results), job.req_id,
                               ", ".join(sorted({f"{t}:{s}" for t, _, s in bad})))
                meta.bad_pages.extend((tier, key) for tier, key, _ in bad)
            ready.append((job, not bad))
        self._fetching = still
        writing = []
        for tier, key, future in self._writing:
            if future.done():
                ok = future.result()
                meta.tier_events[(tier, "stored" if ok else "refused")] += 1
            else:
                writing.append((tier, key, future))
        self._writing = writing
        for name, store in self.tiers.items():
            meta.removed_pages.extend((name, key) for key in store.take_removed())
        return ready

    def close(self) -> None:
        for pool in self._io.values():
            pool.shutdown(wait=True, cancel_futures=True)
        for store in self.tiers.values():
            store.close()
        self.tiers, self._io = {}, {}


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _gather(futures: list[Future]) -> Future:
    """A future of the concatenated results of ``futures``."""
    if len(futures) == 1:
        return futures[0]
    combined: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:  # callbacks run on the tiers' I/O threads
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            combined.set_result([r for f in futures for r in f.result()])
    for future in futures:
        future.add_done_callback(one_done)
    return combined


def open_tiers(config: "KVBMConfig", info: "EngineInfo", rank: int) -> list["TierStore"]:
    """This worker's stores of the configured disk and remote tiers."""
    stores: list[TierStore] = []
    namespace, world = info.tier_namespace, info.key_namespace.tp_size
    secret = config.page_secret.reveal() if config.page_secret is not None else None
    if config.disk_cache_dir is not None:
        from vllm_kvbm.tiers.disk import DiskStore

        stores.append(DiskStore(config.disk_cache_dir, config.disk_cache_bytes,
                                info.block_bytes, namespace, rank, world, page_secret=secret))
    if config.remote_url is not None and parse_remote_url("remote_url", config.remote_url).resp:
        from vllm_kvbm.tiers.redis_store import RedisStore

        stores.append(RedisStore(parse_remote_url("remote_url", config.remote_url),
                                 config.remote_password, info.block_bytes, namespace, rank,
                                 world, config.remote_timeout_s, page_secret=secret,
                                 tls_ca_file=config.remote_tls_ca_file))
    elif config.remote_url is not None:
        from vllm_kvbm.tiers.remote import RemoteStore

        stores.append(RemoteStore(config.remote_url, info.block_bytes, namespace, rank, world,
                                  config.remote_timeout_s, page_secret=secret))
    return stores
