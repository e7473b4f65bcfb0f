"""Worker side of the connector: host memory, NIXL transfers, completions.

Runs in each vLLM worker process. It owns the host tier's memory and runs the
jobs the scheduler side planned: loads are posted before the forward pass,
stores after it (the blocks' KV exists only then), both asynchronously; each
step's ``get_finished`` polls them and reports what completed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob
from vllm_kvbm.worker.page_mover import PageMover
from vllm_kvbm.worker.tier_io import TierIO

if TYPE_CHECKING:
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.tiers.base import TierStore

logger = logging.getLogger(__name__)

# A transfer still running this long after it was posted is overdue (see
# KVBMWorker._overdue): a stuck copy degrades to a cache miss, never to a
# wrong page or an engine that waits forever for a preempted request's store.
TRANSFER_TIMEOUT_S = 30.0


@dataclass
class _InFlight:
    job: TransferJob
    is_store: bool
    handle: object
    started: float
    # past the timeout and already dealt with; still polled until NIXL ends it
    overdue: bool = False


class KVBMWorker:
    def __init__(self, info: "EngineInfo", num_host_slots: int, nixl_backend: str,
                 agent_name: str, transfer_timeout_s: float = TRANSFER_TIMEOUT_S):
        self.info = info
        self.transfer_timeout_s = transfer_timeout_s
        self.num_host_slots = num_host_slots
        self.nixl_backend = nixl_backend
        self.agent_name = agent_name
        self.mover: PageMover | None = None
        self.host_pool: torch.Tensor | None = None
        self._inflight: list[_InFlight] = []
        self._awaiting_free: set[str] = set()
        self._load_error_blocks: set[int] = set()
        self._meta = KVBMWorkerMetadata()
        self._finished_recving: set[str] = set()
        # Lower tiers (disk, remote), each on an I/O thread of its own.
        self.tier_io = TierIO()

    def add_tier(self, store: "TierStore") -> None:
        self.tier_io.add(store)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        first = next(iter(kv_caches.values()))
        pin = first.is_cuda  # pinned host memory lets the GPU DMA into it
        self.host_pool = torch.zeros((self.num_host_slots, self.info.block_bytes),
                                     dtype=torch.uint8, pin_memory=pin)
        self.mover = PageMover(kv_caches, num_blocks, self.host_pool,
                               backend=self.nixl_backend, name=self.agent_name)
        logger.info("KVBM worker: %d KV layers registered with NIXL, host tier %d blocks "
                    "(%.2f GiB)", len(kv_caches), self.num_host_slots,
                    self.host_pool.numel() / 1024**3)

    # ---- posting ----------------------------------------------------------

    def _post(self, job: TransferJob, is_store: bool) -> None:
        assert self.mover is not None
        try:
            handle = self.mover.post(is_store, job.block_ids, job.slots)
        except Exception as err:
            logger.warning("KVBM: could not start %s of %d blocks for %s: %s",
                           "store" if is_store else "load", len(job.block_ids),
                           job.req_id, err)
            self._complete(job, is_store, ok=False, started=time.perf_counter())
            return
        self._inflight.append(_InFlight(job, is_store, handle, time.perf_counter()))

    def start_loads(self, meta: KVBMConnectorMetadata) -> None:
        for job in meta.loads:
            if not job.fetch:
                self._post(job, is_store=False)
            elif any(job.slots[i] < 0 for i, _, _ in job.fetch):
                # The scheduler had no host slot for a promotion: recompute.
                self._complete(job, False, ok=False, started=time.perf_counter())
            else:
                # Lower-tier pages go into their host slots first (on the
                # tiers' I/O threads), then the whole job is one NIXL read.
                assert self.host_pool is not None
                self.tier_io.fetch(job, self.host_pool)

    def start_stores(self, meta: KVBMConnectorMetadata) -> None:
        for job in meta.stores:
            self._post(job, is_store=True)
        self._awaiting_free.update(meta.delayed_free_req_ids)
        for spill in meta.spills:
            assert self.host_pool is not None
            self.tier_io.spill(spill, self.host_pool[spill.slot])
            self._meta.spills_done[spill.job_id] += 1  # the slot may be reused now

    def handle_preemptions(self, meta: KVBMConnectorMetadata) -> None:
        """Preempted requests' blocks are reused by this very step: finish
        reading them first."""
        if meta.flush_req_ids:
            req_ids = set(meta.flush_req_ids)
            # An overdue one is reported failed and holds only host slots.
            self._wait(lambda f: f.is_store and f.job.req_id in req_ids)

    # ---- completion -------------------------------------------------------

    def _complete(self, job: TransferJob, is_store: bool, ok: bool, started: float) -> None:
        elapsed = time.perf_counter() - started
        nbytes = len(job.block_ids) * self.info.block_bytes
        meta = self._meta
        if is_store:
            (meta.stores_done if ok else meta.stores_failed)[job.job_id] += 1
            if ok:
                meta.bytes_stored += nbytes
                meta.store_latencies.append(elapsed)
        else:
            if ok:
                meta.bytes_loaded += nbytes
                meta.load_latencies.append(elapsed)
            else:
                meta.loads_failed[job.req_id] += 1
                self._load_error_blocks.update(job.block_ids)
            # Reported even when failed: vLLM recomputes the failed blocks.
            self._finished_recving.add(job.req_id)

    def _poll(self) -> None:
        """Collects finished transfers and deals with overdue ones."""
        assert self.mover is not None
        now = time.perf_counter()
        still = []
        for f in self._inflight:
            state = self.mover.poll(f.handle)
            if state != "PROC":
                if f.overdue and f.is_store:
                    # Already reported failed; its slots may be reused now.
                    self._meta.slots_released.update(f.job.slots)
                    logger.warning("KVBM: overdue store for %s ended (%s); its %d host "
                                   "slots are free again", f.job.req_id, state,
                                   len(f.job.slots))
                else:
                    self._complete(f.job, f.is_store, ok=state == "DONE", started=f.started)
                continue
            if not f.overdue and now - f.started > self.transfer_timeout_s:
                f.overdue = True
                self._overdue(f)
            still.append(f)
        self._inflight = still

    def _overdue(self, f: _InFlight) -> None:
        """A transfer still running after the timeout.

        NIXL cannot be trusted to cancel it: releasing a running UCX transfer
        returned success here and then crashed UCX at close (an arbiter
        assertion), so the handle is kept and polled until NIXL ends it.
        Meanwhile nothing it may still write is handed out: a store is
        reported failed (the blocks are not cached, and vLLM may free or reuse
        the engine blocks it reads) and its host slots are held back from the
        host tier until it ends; a load keeps its request waiting, because
        the engine blocks it writes must not be given to anyone else.
        """
        self._meta.transfers_overdue += 1
        if f.is_store:
            logger.error("KVBM: store of %d blocks for %s not finished after %g s; not "
                         "cached, its host slots held until NIXL ends it",
                         len(f.job.block_ids), f.job.req_id, self.transfer_timeout_s)
            self._meta.slots_held.update(f.job.slots)
            self._complete(f.job, True, ok=False, started=f.started)
        else:
            logger.error("KVBM: load of %d blocks for %s not finished after %g s; the "
                         "request waits for it (its blocks are still being written)",
                         len(f.job.block_ids), f.job.req_id, self.transfer_timeout_s)

    def _wait(self, match) -> bool:
        """Polls until no transfer ``match``es but overdue ones; True if none is left."""
        def busy() -> bool:
            return any(match(f) and not f.overdue for f in self._inflight)

        while busy():
            self._poll()
            if busy():
                time.sleep(0.0005)
        return not any(match(f) for f in self._inflight)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for job, ok in self.tier_io.poll(self._meta):
            if ok:
                self._post(job, is_store=False)
            else:
                self._complete(job, False, ok=False, started=time.perf_counter())
        if self.mover is not None and self._inflight:
            self._poll()
        # An overdue store was reported failed: it no longer delays the free.
        storing = {f.job.req_id for f in self._inflight if f.is_store and not f.overdue}
        sending = {r for r in self._awaiting_free if r not in storing}
        self._awaiting_free -= sending
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_error_blocks = self._load_error_blocks, set()
        return errors

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
        meta, self._meta = self._meta, KVBMWorkerMetadata()
        if meta.is_empty() and not meta.bytes_loaded and not meta.load_latencies:
            return None
        return meta

    def shutdown(self) -> None:
        self.tier_io.close()
        if self.mover is None:
            return
        if not self._wait(lambda f: True):
            # Deregistering memory under a running transfer is undefined:
            # leave it to process exit.
            logger.error("KVBM: %d transfers still running at shutdown; NIXL memory "
                         "left registered", len(self._inflight))
            self.mover = None
            return
        self.mover.close()
        self.mover = None

