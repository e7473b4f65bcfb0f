"""Resets: forgetting every cached page of this engine (a new key epoch), and
vLLM's prefix-cache resets, after which the workers digest their weights
again (scheduler/weights_epochs.py)."""

from __future__ import annotations

import logging
import os

from vllm_kvbm.keys import derive_seed

logger = logging.getLogger(__name__)


class CacheReset:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): cache reset."""

    def reset_cache(self) -> bool:
        """Forgets every cached page, in every tier, for this engine; False
        (and nothing forgotten) when vLLM's own prefix cache was not reset.

        The host tier is cleared. The disk and remote tiers are shared with
        other engines and restarts, so their pages are not deleted: instead
        this engine's keys move to a new epoch (a fresh random seed), so no
        page stored before the reset is ever looked up again here; the old
        pages age out by LRU. Other engines sharing a store still see the
        pre-reset pages and not this engine's new ones.

        vLLM calls this even when its own reset failed (blocks still in use):
        its cached blocks then keep serving pre-reset KV to new requests, and
        pages computed on top of them must not get post-reset keys. So the
        reset is refused as a whole, and the caller retries as it would for
        vLLM's own refusal (or resets with ``reset_running_requests``).
        """
        if not self._vllm_cache_was_reset():
            logger.warning("KVBM: cache reset refused: vLLM's own prefix cache was not reset "
                           "(blocks still in use); retry when requests finish, or reset with "
                           "reset_running_requests=True")
            return False
        dropped = self.host.clear()
        self.events.reset()
        # Stores still being written are not cleared; drop them when they land.
        for job in self._store_jobs.values():
            job.stale = True
        self._base_seed = derive_seed(self._base_seed, "reset", os.urandom(16).hex())
        self._new_keys()
        self._epoch += 1
        logger.info("KVBM: cache reset dropped %d host pages; disk and remote pages from "
                    "before it are no longer looked up (key epoch %d)", dropped, self._epoch)
        return True

    def _new_keys(self) -> None:
        """Keys from the current seed for every request: KV computed (or
        being loaded) before never gets a new key; lookups use the new ones."""
        self._seed = self.weights.seed(self._base_seed)
        for state in self._reqs.values():
            if state.request.num_computed_tokens > 0 or state.load.in_flight():
                state.no_store = True
            else:  # computes from scratch (e.g. preempted by the reset): store it all anew
                state.store.cursor = 0
            state.chain = self._key_chain(state.request, state.salt)

    def _watch_prefix_cache_resets(self, manager) -> None:
        """Each successful reset of vLLM's prefix cache (with or without
        ``reset_connector``: RL frameworks reset it after every weight sync)
        starts a weights epoch: the workers digest their weights again."""
        reset = manager.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            done = reset()
            if done:
                self.weights.new_epoch()
            return done
        manager.reset_prefix_cache = reset_prefix_cache

    def _vllm_cache_was_reset(self) -> bool:
        """vLLM resets its prefix cache only when no block is in use but the
        null block (BlockPool.reset_prefix_cache): the same test, on the same
        thread, right after (or before) it ran."""
        manager = self._kv_cache_manager
        pool = getattr(manager, "block_pool", None)
        if pool is None:
            return True  # no vLLM cache bound: nothing of vLLM's can be stale
        return pool.num_gpu_blocks - pool.get_num_free_blocks() <= 1
