"""The engine's KV memory going away and coming back: vLLM's sleep mode, its
``release_kv_cache_memory()`` and vLLM 0.34's weight updates that borrow an
extensible KV cache.

vLLM >= 0.33 calls the connector's ``unregister_kv_caches`` right before it
frees that memory and ``restore_kv_caches`` once it is mapped again; on 0.32
the worker's ``sleep``, ``wake_up`` and ``discard`` make the same calls
(sleep_mode.py). Both land here. Release is:

- transfers still behind their step's fence (never posted) fail unposted: a
  store is not cached, a load is recomputed;
- posted transfers are waited for, each until the transfer timeout from its
  post (at a sleep the engine is paused and its stream synchronized, so a
  copy normally ends in milliseconds);
- from then on every job is refused before it touches the memory, until
  restore.

A transfer still running after its timeout may yet read or write the memory
vLLM is about to unmap: that would be a copy into freed memory (on a GPU, a
fault that kills the engine's process). So the release raises instead, and
the call that would free the memory (sleep, discard, the weight update)
fails with that message before anything is freed; the worker stays attached.
Nothing needs registering again at restore: the copy engines copy GPU KV by
address and vLLM keeps the addresses across sleep (the cumem allocator, the
extensible KV cache); on vLLM's CPU build sleep frees nothing.
"""

from __future__ import annotations

import logging

from vllm_kvbm.messages import TransferJob

logger = logging.getLogger(__name__)


class KVMemoryBusy(RuntimeError):
    """A transfer outlived the timeout: the KV memory must not be freed yet."""


class KVRelease:
    """Part of ``KVBMWorker`` (worker.py, which holds the state)."""

    # Why the engine's KV memory is released (None: attached, jobs run).
    kv_released: str | None = None

    def release_kv(self, why: str) -> None:
        """Drains the transfers that touch the engine's KV memory and refuses
        jobs until ``restore_kv``. Idempotent. Raises KVMemoryBusy (and stays
        attached) if a posted transfer is still running after its timeout."""
        first = self.kv_released is None
        self.kv_released = why
        unposted = len(self._pending)
        for p in self._pending:  # never posted: they touched nothing
            self._complete(p.job, p.is_store, ok=False, started=p.queued)
        self._pending = []
        running = len(self._inflight)
        if self.mover is not None and not self._wait(lambda job, is_store: True):
            stuck = self._inflight
            self.kv_released = None  # nothing is freed: the engine goes on as it was
            raise KVMemoryBusy(
                f"KVBM: cannot let vLLM release the KV cache's memory ({why}): "
                f"{len(stuck)} transfer(s) between it and the host tier are still running "
                f"after the transfer timeout ({self.transfer_timeout_s:g} s; the oldest "
                f"for request {stuck[0].job.req_id}). Nothing was released; a copy that "
                f"runs this long means the device is stuck: retry, or restart the engine"
            )
        if first:
            logger.info(
                "KVBM: the engine's KV memory is released (%s): %d queued transfers "
                "not started, %d running ones finished first; loads and stores are "
                "refused until it is back",
                why,
                unposted,
                running,
            )

    def restore_kv(self) -> None:
        """The engine's KV memory is mapped again (at the same addresses)."""
        if self.kv_released is not None:
            logger.info(
                "KVBM: the engine's KV memory is back (after %s); loads and stores run again",
                self.kv_released,
            )
        self.kv_released = None

    def _refused_released(self, job: TransferJob, is_store: bool, started: float) -> bool:
        """True (and the job failed: a store not cached, a load recomputed)
        while the engine's KV memory is released."""
        if self.kv_released is None:
            return False
        logger.info(
            "KVBM: %s of %d blocks for %s refused: the engine's KV memory is released (%s)",
            "store" if is_store else "load",
            len(job.block_ids),
            job.req_id,
            self.kv_released,
        )
        self._complete(job, is_store, ok=False, started=started)
        return True
