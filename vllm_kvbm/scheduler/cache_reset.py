"""Resets: the connector's (the host tier and the stores in flight
forgotten; the host tier kept when the reset is part of a pause or sleep),
and vLLM's prefix-cache resets; each starts a weights epoch, on which the
workers label their weights again (scheduler/weights_epochs.py)."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

# Frames between the connector's reset and vLLM's EngineCore._reset_caches
# (connector, Scheduler.reset_connector_cache, .reset_prefix_cache,
# EngineCore.reset_prefix_cache), with room to spare.
_STACK_DEPTH = 16


def part_of_a_pause() -> bool:
    """Whether this reset is the one vLLM makes as it completes a pause of
    its own: ``EngineCore._reset_caches`` (sleep at level >= 1, a pause with
    ``clear_cache``, ``release_kv_cache_memory()``) calling, with the engine's
    scheduler paused. An explicit ``reset_prefix_cache(reset_connector=True)``
    reaches the connector without it; anything not recognised counts as explicit."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001 - no vLLM engine here: not vLLM's pause
        return False
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        engine = frame.f_locals.get("self")
        if frame.f_code.co_name == "_reset_caches" and isinstance(engine, EngineCore):
            try:
                return bool(engine.is_scheduler_paused())
            except Exception:  # noqa: BLE001 - unsure: as an explicit reset
                return False
        frame = frame.f_back
    return False


class CacheReset:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): cache reset."""

    def reset_cache(self) -> bool:
        """Forgets what this engine holds in memory: the host tier is cleared
        and stores in flight are dropped when they land (their KV may be of
        the weights before an update). False (and nothing forgotten) when
        vLLM's own prefix cache was not reset.

        The reset vLLM makes as it completes a pause (``part_of_a_pause``:
        sleep at level >= 1 calls it) keeps the host tier: its pages are
        keyed by the weights they were computed with, so after a level-1
        sleep they hit again, and after new weights they are never looked up
        (they age out). Stores in flight are dropped all the same.

        Keys stay a function of what the KV depends on, the namespace's seed
        and the weights the workers run, never of the reset itself: the reset
        starts a weights epoch (as vLLM's own prefix-cache reset does; vLLM
        may call this without or before that hook), the workers label their
        weights, and until their labels are in, every job is keyed under the
        weights known before and refused by a worker whose weights differ.
        So disk and remote pages of the same weights stay valid and are
        served again, here and on every engine that received the same update,
        and pages of other weights are never looked up nor onboarded.

        vLLM calls this even when its own reset failed (blocks still in use):
        its cached blocks then keep serving pre-reset KV to new requests, and
        pages computed on top of them must not get post-reset keys. So the
        reset is refused as a whole, and the caller retries as it would for
        vLLM's own refusal (or resets with ``reset_running_requests``).
        """
        if not self._vllm_cache_was_reset():
            logger.warning(
                "KVBM: cache reset refused: vLLM's own prefix cache was not reset "
                "(blocks still in use); retry when requests finish, or reset with "
                "reset_running_requests=True"
            )
            return False
        paused = part_of_a_pause()
        if paused:
            kept = "the host tier kept (a pause's reset)"
        else:
            kept = f"{self.host.clear()} host pages dropped"
            self.events.host_cleared()
        # Stores still being written are not cleared; drop them when they land.
        for job in self._store_jobs.values():
            job.stale = True
        self.weights.new_epoch()
        self._new_keys()
        logger.info(
            "KVBM: cache reset: %s, %d stores in flight dropped; weights epoch %d: "
            "pages are served again where the workers' weights are those they were "
            "stored under",
            kept,
            len(self._store_jobs),
            self.weights.epoch,
        )
        return True

    def _new_keys(self) -> None:
        """Keys from the current seed for every request: KV computed (or
        being loaded) before never gets a new key; lookups use the new ones."""
        seed = self.weights.seed(self._base_seed)
        if seed != self._seed:  # no page under the old keys is looked up again
            self.events.keys_moved()
        self._seed = seed
        for state in self._reqs.values():
            if state.request.num_computed_tokens > 0 or state.load.in_flight():
                state.no_store = True
            else:  # computes from scratch (e.g. preempted by the reset): store it all anew
                state.store.cursor = 0
            state.chain = self._key_chain(state.request, state.salt)

    def _watch_prefix_cache_resets(self, manager) -> None:
        """Each successful reset of vLLM's prefix cache (with or without
        ``reset_connector``: RL frameworks reset it after every weight sync)
        starts a weights epoch: the workers label their weights again."""
        reset = manager.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            done = reset()
            if done and self.weights.new_epoch():
                self._new_keys()  # the labels the workers announced for it
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
