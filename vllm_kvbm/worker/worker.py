"""KVBMWorker, the worker side of the connector: host memory, NIXL transfers,
completions.

Runs in each vLLM worker process. It owns the host tier's memory and runs the
jobs the scheduler side planned, asynchronously; each step's ``get_finished``
polls them and reports what completed.

Stream order (CUDA). vLLM 0.32 calls ``wait_for_save`` right after it
*launches* the step's forward pass (``start_load_kv`` too, unless a load of
the step is synchronous: then just before it, after the zeroing of new
blocks), and NIXL copies on streams of its own, so each step's transfers wait for a ``StepFence`` recorded on the current
stream when the connector was called: a store never reads a page before the
forward pass has written it. The copy engines (GPU KV) get the fence with
the post, made at once, and their stream waits for its event on the GPU, as
vLLM's own offloading's copy stream waits for the current one
(v1/kv_offload/cpu/gpu_worker.py, v1/simple_kv_offload/worker.py); a NIXL
post takes no stream, so NIXL transfers are posted only once the event is
polled done (see ``_post_ready``). What orders each kind of transfer:

- store (engine -> host): after the fence, so after the kernels that write the
  step's KV. The engine blocks stay the request's until the store is reported
  (delayed free, preemption flush), so nothing rewrites them meanwhile; a
  hybrid model's stores also hold their blocks in vLLM's block pool until
  reported (scheduler/store_plan.py), since vLLM frees a sliding window's and
  a state's blocks as the request moves on, and Model Runner V2 zeroes and
  copies new blocks before ``handle_preemptions``.
- load (host -> engine): after the fence too. The blocks were just allocated
  to the request, but kernels queued earlier may still write them: vLLM's
  zeroing of newly allocated blocks (shipped in an earlier step for a block
  since reallocated) and, under async scheduling, a step still running for
  the block's previous owner; a NIXL write that landed first would be
  overwritten. The other direction needs no fence: the request waits in
  WAITING_FOR_REMOTE_KVS until ``get_finished`` reports the load, i.e. until
  NIXL saw the copy complete, and only then does the scheduler schedule it,
  so the kernels that read the blocks are launched after the bytes landed.
- spill (host -> disk/remote): host memory only. The scheduler spills a slot
  only after every worker reported its store done (the fence passed and NIXL
  completed the copy into host RAM), and pins it until the spill is copied;
  the copy is a CPU memcpy on a thread of its own (tier_io.py), so no
  stream is involved.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.config import DEFAULT_TIER_READ_TIMEOUT_S, DEFAULT_TIER_WRITE_QUEUE_PAGES
from vllm_kvbm.cpus import spare_cpus
from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob, block_rows
from vllm_kvbm.worker.completions import Completions
from vllm_kvbm.worker.copy_path import make_mover
from vllm_kvbm.worker.early_copies import EarlyCopies, EarlyLoad
from vllm_kvbm.worker.fence import DONE, StepFence, fence_maker
from vllm_kvbm.worker.host_pool import HostPool
from vllm_kvbm.worker import lora_loads
from vllm_kvbm.worker.loaded_weights import LoadedWeights
from vllm_kvbm.worker.jobs import TRANSFER_TIMEOUT_S, InFlight, Pending
from vllm_kvbm.worker.kv_release import KVRelease
from vllm_kvbm.worker.layer_copies import LayerCopies
from vllm_kvbm.worker.layer_reads import LayerReader
from vllm_kvbm.worker.layered_steps import LayeredSteps
from vllm_kvbm.worker.streamed_loads import StreamedLoads
from vllm_kvbm.worker.streaming import StagingSlots, StreamedLoad, needs_streaming, staging_slots
from vllm_kvbm.worker.tier_io import TierIO

if TYPE_CHECKING:
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.tiers.base import TierStore

logger = logging.getLogger(__name__)


class KVBMWorker(LayeredSteps, StreamedLoads, EarlyCopies, KVRelease, Completions):
    def __init__(
        self,
        info: "EngineInfo",
        num_host_slots: int,
        nixl_backend: str,
        agent_name: str,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        tier_write_queue_pages: int = DEFAULT_TIER_WRITE_QUEUE_PAGES,
        tier_read_timeout_s: float = DEFAULT_TIER_READ_TIMEOUT_S,
        host_copy_path: str = "auto",
        layered_loads: bool = True,
    ):
        """``layered_loads``: whether host hits may be loaded layer by layer
        during the forward pass (off with a draft model: its step reports
        the connector's results before ``wait_for_save``)."""
        self.info = info
        self.host_copy_path = host_copy_path
        self.transfer_timeout_s = transfer_timeout_s
        self.num_host_slots = num_host_slots
        self.nixl_backend = nixl_backend
        self.agent_name = agent_name
        self.mover = None  # page_mover.PageMover or copy_engine.CopyEngineMover
        self.host_pool: torch.Tensor | None = None
        self._host: HostPool | None = None
        # Records the fence of a step's transfers (CUDA event, or always done).
        self.make_fence = lambda: DONE
        self._pending: list[Pending] = []
        # Loads whose pages are being fetched from a lower tier: their fence.
        self._fetching: dict[int, tuple[StepFence, float]] = {}
        self._inflight: list[InFlight] = []
        self._awaiting_free: set[str] = set()
        self._load_error_blocks: set[int] = set()
        # Failed loads of a model of several KV cache groups: vLLM takes no
        # block ids then (they are unique per group only), but the request
        # (failed_recving), and recomputes it whole.
        self._failed_recving: set[str] = set()
        self._meta = KVBMWorkerMetadata()
        self._finished_recving: set[str] = set()
        # Lower tiers (disk, remote), each on a read and a write thread of its own.
        self.tier_io = TierIO(tier_write_queue_pages, tier_read_timeout_s)
        # Staging slots an overdue fetch may still write (not given back yet).
        self._staging_reading: set[int] = set()
        # Loads streamed through staging slots (see streaming.py): each
        # part's (negative) job id -> its load; loads waiting for staging.
        self._staging: StagingSlots | None = None
        self._parts: dict[int, StreamedLoad] = {}
        self._streams_waiting: list[StreamedLoad] = []
        self._part_ids = itertools.count(-1, -1)
        # Loads whose landed pages were copied while their fetch ran
        # (early_copies.py), by job id; each such copy's job id -> its load.
        self._early: dict[int, EarlyLoad] = {}
        self._early_parts: dict[int, EarlyLoad] = {}
        lora_loads.watch()  # before vLLM loads any adapter in this process
        self.weights = LoadedWeights(0, None)  # the connector sets vLLM's model's
        # Copies made during the forward pass, where a core is free (layer_copies.py).
        self._layer_copies: LayerCopies | None = None
        self._layered_off = False  # a layer ran without waiting for its loads
        self.layered_loads = layered_loads
        # Disk hits read layer by layer (layer_reads.py): off for a while
        # after reads missed their deadline.
        self._layer_reader: LayerReader | None = None
        self._reads_off = False
        self._reads_stuck = 0  # steps whose reads still run after their deadline
        self._reads_back_at = 0.0
        self._peer_in_place = False  # said to the scheduler (layered_peer_workers)

    def add_tier(self, store: "TierStore", rank: int = 0) -> None:
        """``rank``: this worker's TP rank, which the tier's outcomes name."""
        self.tier_io.rank = rank
        self.tier_io.add(store, self.host_pool)
        self._start_layer_reads(store)

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_dims: dict[str, int] | None = None,
    ) -> None:
        """``block_dims``: each layer's block dimension, from vLLM's declared
        KV layout (see vllm_kvbm.vllm_layout); None: found from the shapes
        where that is unambiguous."""
        first = next(iter(kv_caches.values()))
        # Pinned host memory lets the GPU DMA into it. The rows after the
        # host tier's are the staging slots of streamed loads.
        staging = staging_slots(self.info.page_bytes)
        self._staging = StagingSlots(self.num_host_slots, staging)
        self._host = HostPool(
            self.num_host_slots + staging,
            self.info.page_bytes,
            pin=first.is_cuda,
            device=first.device,
        )
        self.host_pool = self._host.tensor  # a row per page (slot)
        # CPUs none of vLLM's OpenMP threads runs on: where copies run during the forward pass
        spare = set() if first.is_cuda else spare_cpus()
        try:
            # The mover copies blocks: it sees the same memory as a row per block.
            self.mover = make_mover(
                kv_caches,
                num_blocks,
                self.host_pool.view(-1, self.info.block_bytes),
                self.nixl_backend,
                self.agent_name,
                block_dims,
                self.info.page_blocks,
                self.host_copy_path,
                spare,
            )
        except Exception:
            self._host.release()
            raise
        self.make_fence = fence_maker(first.device)
        logger.info(
            "KVBM worker: %d KV layers registered (%s; block dim declared "
            "by vLLM for %d), host tier %d blocks (%.2f GiB%s)",
            len(kv_caches),
            self.mover.path,
            len(block_dims or {}),
            self.num_host_slots,
            self.host_pool.numel() / 1024**3,
            ", pinned" if self._host.pinned else "",
        )
        self._layer_copies = LayerCopies.start(
            self.mover, kv_caches, num_blocks, block_dims, self.info.hybrid, spare
        )
        if self._layer_copies is not None and self.layered_loads:
            self._meta.layered_workers += 1  # the scheduler may ask for layered loads

    # ---- posting ----------------------------------------------------------

    def _post(
        self, job: TransferJob, is_store: bool, started: float, fence: StepFence | None = None
    ) -> None:
        """``fence``: for a mover that orders the copies after it on the GPU.
        Every transfer that touches the engine's KV memory starts here: none
        while that memory is released (kv_release.py)."""
        assert self.mover is not None
        if self._refused_released(job, is_store, started):
            return
        try:
            if fence is None:
                handle = self.mover.post(is_store, *block_rows(job))
            else:
                handle = self.mover.post(is_store, *block_rows(job), after=fence)
        except Exception as err:
            logger.warning(
                "KVBM: could not start %s of %d blocks for %s: %s",
                "store" if is_store else "load",
                len(job.block_ids),
                job.req_id,
                err,
            )
            self._complete(job, is_store, ok=False, started=started)
            return
        self._inflight.append(InFlight(job, is_store, handle, started))

    def _queue(
        self, job: TransferJob, is_store: bool, fence: StepFence, queued: float | None = None
    ) -> None:
        """Posts ``job`` once ``fence`` is done (see the module docstring); at
        once, with the fence, to a mover that orders it on the GPU."""
        queued = time.perf_counter() if queued is None else queued
        if getattr(self.mover, "orders_on_gpu", False):
            self._post(job, is_store, queued, fence)
            return
        self._pending.append(Pending(job, is_store, fence, queued))

    def _post_ready(self) -> None:
        """Posts the queued transfers whose fence is done. Never blocks."""
        if not self._pending:
            return
        now = time.perf_counter()
        still = []
        for p in self._pending:
            if p.fence.done():
                self._post(p.job, p.is_store, started=p.queued)
            elif now - p.queued > self.transfer_timeout_s:
                # Never posted, so it touches no memory: it simply fails (a
                # store is not cached, a load's blocks are recomputed).
                logger.error(
                    "KVBM: %s of %d blocks for %s: the engine's stream did not "
                    "reach it within %g s; dropped",
                    "store" if p.is_store else "load",
                    len(p.job.block_ids),
                    p.job.req_id,
                    self.transfer_timeout_s,
                )
                self._meta.transfer_timeouts["not_started"] += 1
                self._complete(p.job, p.is_store, ok=False, started=p.queued)
            else:
                still.append(p)
        self._pending = still

    def start_loads(self, meta: KVBMConnectorMetadata) -> None:
        fence = self.make_fence() if meta.loads else DONE
        weights_ok = self.weights.serves(meta.weights)
        layered = []
        for job in meta.loads:
            if self._refused(job, False, weights_ok):
                continue
            if job.layered:
                layered.append(job)
            elif needs_streaming(job):
                self._start_streamed(job, fence)
            else:
                self._start_load(job, fence)
        if layered:
            self._start_layered(layered)
        self._post_ready()

    def _start_load(self, job: TransferJob, fence: StepFence) -> None:
        if not job.fetch:
            self._queue(job, False, fence)
            return
        # Lower-tier pages go into their host slots first (on the tiers' I/O
        # threads), and into the engine as they land (early_copies.py), still
        # behind the step's fence.
        assert self.host_pool is not None
        self._fetching[job.job_id] = (fence, time.perf_counter())
        self.tier_io.fetch(job, self.host_pool)

    def _cut_load(self, job: TransferJob, cut: int) -> TransferJob | None:
        """A load whose fetch ran late, cut after its first ``cut`` pages: the
        blocks of the others are load errors (vLLM recomputes from the first),
        and the scheduler keeps the landed pages (``loads_cut``). The job of
        the landed pages, None when there are none (then the load is done)."""
        g = job.page_blocks
        self._meta.loads_cut.append((job.req_id, cut))
        self._load_failed(job.req_id, [b for b in job.block_ids[cut * g :] if b >= 0])
        if cut == 0:
            self._finished_recving.add(job.req_id)
            return None
        return job.page_range(job.job_id, 0, cut)

    def start_stores(self, meta: KVBMConnectorMetadata) -> None:
        for spill in meta.spills:
            # Ready slots (their store completed), pinned by the scheduler
            # until this copy of them is reported; reported even when every
            # tier's write queue was full and no copy was made.
            assert self.host_pool is not None
            pages = [(key, self.host_pool[slot]) for key, slot in zip(spill.keys, spill.slots)]
            self.tier_io.spill(spill.tiers, pages, spill.job_id)
        self._end_layered()
        if meta.stores:
            # The forward pass that writes these blocks is only launched:
            # the copies wait for it.
            fence = self.make_fence()
            weights_ok = self.weights.serves(meta.weights)
            step = self._layer_copies.finish(meta) if self._layer_copies is not None else None
            if step is not None:
                # Copied layer by layer: the last layer's copy is all that may be left.
                step.wait(self.transfer_timeout_s)  # past it: polled, overdue as any
            for job in meta.stores:
                if step is not None and id(job) in step.job_ids:
                    self._inflight.append(InFlight(job, True, step, step.started))
                elif not self._refused(job, True, weights_ok):
                    self._queue(job, True, fence)
        self._awaiting_free.update(meta.delayed_free_req_ids)
        self._post_ready()

    def handle_preemptions(self, meta: KVBMConnectorMetadata) -> None:
        """Preempted requests' blocks, and a hybrid model's sliding-window and
        state blocks the last steps stored, may be reused by this very step:
        finish reading them first (one wait; an overdue store is reported
        failed and holds only host slots)."""
        req_ids = set(meta.flush_req_ids)
        if req_ids or self.info.hybrid:
            self._wait(
                lambda job, is_store: is_store and (job.req_id in req_ids or job.before_next_step)
            )

    def _refused(self, job: TransferJob, is_store: bool, weights_ok: bool = True) -> bool:
        """A job whose keys name other weights than this worker runs (the model's
        changed in memory, ``weights_ok`` False, logged by LoadedWeights; or a LoRA
        adapter's) fails before it touches memory: a store is not cached, a load recomputed."""
        if job.refuse:
            self._complete(job, is_store, ok=False, started=time.perf_counter())
            return True
        if weights_ok and not lora_loads.refuses(job.adapter):
            return False
        int_id, fingerprint = job.adapter or (0, "")
        if weights_ok and fingerprint:
            logger.warning(
                "KVBM: %s for %s refused: LoRA adapter id %d runs other weights than "
                "its files had when the request arrived (rewritten in place)",
                "store" if is_store else "load",
                job.req_id,
                int_id,
            )
        elif weights_ok:  # keyed before its files were local: vLLM downloaded them as it loaded it
            logger.info(
                "KVBM: %s for %s not done: LoRA adapter id %d had no local files when "
                "the request arrived; its next requests are cached",
                "store" if is_store else "load",
                job.req_id,
                int_id,
            )
        self._complete(job, is_store, ok=False, started=time.perf_counter())
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for job, ok, reading, cut in self.tier_io.poll(self._meta):
            fence, queued = self._fetching.pop(job.job_id, (DONE, time.perf_counter()))
            if reading and not ok:
                self._hold_read_slots(job, True)
            if self._fetched_early(job, ok, cut, fence):
                continue
            if cut is not None:
                job = self._cut_load(job, cut)
                if job is None:
                    continue
            if ok:
                self._queue(job, False, fence, queued)
                continue
            self._complete(job, False, ok=False, started=queued)
        self._copy_landed()
        for job in self.tier_io.take_ended():
            self._hold_read_slots(job, False)
        self._reads_ended_late()
        self._peer_reads_in_place()
        self._expire_waiting_streams()
        self._post_ready()
        if self.mover is not None and self._inflight:
            self._poll()
        # An overdue store was reported failed: it no longer delays the free.
        storing = {f.job.req_id for f in self._inflight if f.is_store and not f.overdue}
        storing |= {p.job.req_id for p in self._pending if p.is_store}
        sending = {r for r in self._awaiting_free if r not in storing}
        self._awaiting_free -= sending
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def take_failed_recving(self, recving: set[str]) -> set[str]:
        """The requests of ``recving`` (just reported finished) whose load
        failed; vLLM wants them in the same report."""
        failed = self._failed_recving & recving
        self._failed_recving -= failed
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_error_blocks = self._load_error_blocks, set()
        return errors

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
        meta, self._meta = self._meta, KVBMWorkerMetadata()
        meta.adapters_loaded = lora_loads.take_unreported()
        meta.weights_digested = self.weights.take_unreported()
        if meta.is_empty() and not meta.bytes_loaded and not meta.load_latencies:
            return None
        return meta

    def shutdown(self) -> None:
        # the read thread first: it uses the tiers' stores (a peer's landing
        # memory) until it stops
        reads_stopped = self._close_layer_reads()
        self.tier_io.close()
        # Not posted yet: they have touched no memory, and nothing after
        # shutdown could use them. Dropped without waiting for the engine.
        self._pending = []
        if self.mover is None:
            return
        if not self._wait(lambda job, is_store: True):
            # Deregistering memory under a running transfer is undefined:
            # leave it to process exit.
            logger.error(
                "KVBM: %d transfers still running at shutdown; their memory left registered",
                len(self._inflight),
            )
            self.mover = None
            return
        if self._layer_copies is not None:
            self._layer_copies.close()
            self._layer_copies = None
        self.mover.close()
        self.mover = None
        if self._host is not None and reads_stopped:
            self._host.release()
