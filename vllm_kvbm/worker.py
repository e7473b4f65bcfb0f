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

from vllm_kvbm.metadata import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob
from vllm_kvbm.page_mover import PageMover

if TYPE_CHECKING:
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

# A transfer still running after this long is treated as failed, so a stuck
# copy degrades to a cache miss instead of hanging the engine.
FLUSH_TIMEOUT_S = 30.0


@dataclass
class _InFlight:
    job: TransferJob
    is_store: bool
    handle: object
    started: float


class KVBMWorker:
    def __init__(self, info: "EngineInfo", num_host_slots: int, nixl_backend: str,
                 agent_name: str):
        self.info = info
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
            self._post(job, is_store=False)

    def start_stores(self, meta: KVBMConnectorMetadata) -> None:
        for job in meta.stores:
            self._post(job, is_store=True)
        self._awaiting_free.update(meta.delayed_free_req_ids)

    def handle_preemptions(self, meta: KVBMConnectorMetadata) -> None:
        """Preempted requests' blocks are reused by this very step: finish
        reading them first."""
        if meta.flush_req_ids:
            req_ids = set(meta.flush_req_ids)
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

    def _poll(self, force=None, deadline: float | None = None) -> None:
        assert self.mover is not None
        still = []
        for f in self._inflight:
            state = self.mover.poll(f.handle)
            if state == "PROC" and force is not None and force(f) and deadline is not None \
                    and time.perf_counter() > deadline:
                logger.error("KVBM: %s for %s did not finish in %.0f s; dropping it",
                             "store" if f.is_store else "load", f.job.req_id, FLUSH_TIMEOUT_S)
                state = "ERR"  # the stored copy is dropped; KV is recomputed
            if state == "PROC":
                still.append(f)
            else:
                self._complete(f.job, f.is_store, ok=state == "DONE", started=f.started)
        self._inflight = still

    def _wait(self, match) -> None:
        deadline = time.perf_counter() + FLUSH_TIMEOUT_S
        while any(match(f) for f in self._inflight):
            self._poll(force=match, deadline=deadline)
            if any(match(f) for f in self._inflight):
                time.sleep(0.0005)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.mover is not None and self._inflight:
            self._poll()
        storing = {f.job.req_id for f in self._inflight if f.is_store}
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
        if self.mover is None:
            return
        self._wait(lambda f: True)
        self.mover.close()
        self.mover = None
