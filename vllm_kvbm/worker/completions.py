"""Completions, the worker's side: each transfer's outcome reported to the
scheduler (counts, bytes, latencies, a failed load's blocks), the running
transfers polled, an overdue one kept until it ends, and the waits for the
transfers a caller must see finished."""

from __future__ import annotations

import logging
import time

from vllm_kvbm.messages import TransferJob, block_rows
from vllm_kvbm.worker.jobs import InFlight

logger = logging.getLogger(__name__)


class Completions:
    """Part of ``KVBMWorker`` (worker.py, which holds the state): completions,
    polling and overdue transfers."""

    def _complete(self, job: TransferJob, is_store: bool, ok: bool, started: float) -> None:
        load = self._parts.pop(job.job_id, None)
        if load is not None:  # one part of a streamed load
            self._part_done(load, job, ok)
            return
        if self._early_part_done(job, ok):  # a copy of a load's first pages
            return
        elapsed = time.perf_counter() - started
        nbytes = job.num_blocks * self.info.block_bytes
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
                self._load_failed(job.req_id, block_rows(job)[0])
            # Reported even when failed: vLLM recomputes the failed blocks. A
            # layered load is synchronous to vLLM: never in finished_recving.
            if job.layered:
                meta.loads_done[job.req_id] += 1
                meta.layered_waits[job.req_id] = elapsed
            else:
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
                    logger.warning(
                        "KVBM: overdue store for %s ended (%s); its %d host slots are free again",
                        f.job.req_id,
                        state,
                        len(f.job.slots),
                    )
                else:
                    self._complete(f.job, f.is_store, ok=state == "DONE", started=f.started)
                continue
            if not f.overdue and now - f.started > self.transfer_timeout_s:
                f.overdue = True
                self._overdue(f)
            still.append(f)
        self._inflight = still

    def _overdue(self, f: InFlight) -> None:
        """A transfer still running after the timeout.

        It is never cancelled (NIXL cannot be trusted to: releasing a running
        UCX transfer returns success and then crashes UCX at close, an arbiter
        assertion), so the handle is kept and polled until the mover (NIXL or
        the copy engine) ends it.
        Meanwhile nothing it may still write is handed out: a store is
        reported failed (the blocks are not cached, and vLLM may free or reuse
        the engine blocks it reads) and its host slots are held back from the
        host tier until it ends; a load keeps its request waiting, because
        the engine blocks it writes must not be given to anyone else.
        """
        self._meta.transfer_timeouts["overdue"] += 1
        if f.is_store:
            logger.error(
                "KVBM: store of %d blocks for %s not finished after %g s; not "
                "cached, its host slots held until the copy ends",
                len(f.job.block_ids),
                f.job.req_id,
                self.transfer_timeout_s,
            )
            self._meta.slots_held.update(f.job.slots)
            self._complete(f.job, True, ok=False, started=f.started)
        else:
            logger.error(
                "KVBM: load of %d blocks for %s not finished after %g s; the "
                "request waits for it (its blocks are still being written)",
                len(f.job.block_ids),
                f.job.req_id,
                self.transfer_timeout_s,
            )

    def _wait(self, match) -> bool:
        """Waits for the fences of the queued transfers that ``match(job,
        is_store)`` (these callers must wait anyway), posts them, and polls
        until no matching transfer is left but overdue ones; True if none is."""
        for p in self._pending:
            if match(p.job, p.is_store):
                p.fence.wait()
        self._post_ready()

        def busy() -> bool:
            return any(match(p.job, p.is_store) for p in self._pending) or any(
                match(f.job, f.is_store) and not f.overdue for f in self._inflight
            )

        while busy():
            self._poll()
            self._post_ready()
            if busy():
                time.sleep(0.0005)
        return not any(match(f.job, f.is_store) for f in self._inflight)

    def _load_failed(self, req_id: str, blocks: list[int]) -> None:
        """``blocks`` of ``req_id``'s load hold no valid KV: vLLM recomputes
        them (a hybrid model: the whole request)."""
        if self.info.hybrid:
            self._failed_recving.add(req_id)
        else:
            self._load_error_blocks.update(blocks)
