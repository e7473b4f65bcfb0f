"""What the workers report each step (KVBMWorkerMetadata, finished loads):
metrics, finished stores, spills and loads, tier and KV events."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvbm.messages import KVBMWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput


class WorkerReports:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): worker reports."""

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBMWorkerMetadata):
            self.stats.add("offload_bytes_d2h", meta.bytes_stored)
            self.stats.add("onboard_bytes_h2d", meta.bytes_loaded)
            self.stats.observe("offload_latency_seconds", meta.store_latencies)
            self.stats.observe("onboard_latency_seconds", meta.load_latencies)
            for tier, seconds in meta.tier_read_seconds:
                self.stats.observe("tier_read_latency_seconds", [seconds], tier)
            for tier, seconds in meta.tier_write_seconds:
                self.stats.observe("tier_write_latency_seconds", [seconds], tier)
            for (tier, rank), (used, capacity) in meta.tier_usage.items():
                # Per worker, as the host tier's: the fullest rank's
                self._tier_usage[tier][rank] = (used, capacity)
                ranks = self._tier_usage[tier].values()
                self.stats.set_gauge(f"{tier}_cache_used_bytes", max(u for u, _ in ranks))
                self.stats.set_gauge(f"{tier}_cache_capacity_bytes", max(c for _, c in ranks))
            for (tier, rank), counts in meta.tier_counts.items():
                self._store_counts(tier, rank, counts)
            if meta.pool_served_at is not None:
                # this engine's pool endpoint: never asked as a peer, and
                # named in its pool pages' KV events
                self.lower.set_own_endpoint(meta.pool_served_at or None)
                self.events.pool_owner = meta.pool_served_at or None
            for event, count in meta.transfer_timeouts.items():
                self.stats.add("transfer_timeouts", count, event)
            # A synchronous (layered) load that failed: its step computed on
            # top of KV that may be bad, and so may every store in flight
            # (this step's; under async scheduling the next one's too):
            # never serve them (their keys dropped as they land).
            if any(self._layered_load(req_id) for req_id in meta.loads_failed):
                for job in self._store_jobs.values():
                    job.stale = True
            # Held before the failed stores drop their keys, so those slots
            # never reach the free list while a late write may land in them.
            self.host.hold(meta.slots_held.elements())
            self._finish_stores(meta.stores_done, ok=True)
            self._finish_stores(meta.stores_failed, ok=False)
            self.host.release(meta.slots_released.elements())
            self._finish_spills(meta.spills_done)
            self.lower.record(meta.tier_events, self.stats, self.info.num_workers)
            for int_id, fingerprint in meta.adapters_loaded:
                self.adapters.loaded(int_id, fingerprint)
            if meta.weights_digested and self.weights.reported(meta.weights_digested):
                # Other weights than the keys named: keys from their digest.
                # The old keys' pages stay (found again should the weights
                # come back), never served meanwhile.
                self._new_keys()
            self.events.lower_stored(meta.tier_stored)
            for tier, key in meta.bad_pages + meta.removed_pages:
                self.lower.forget(tier, key)
                self.events.lower_removed(tier, key)
            # With tensor parallelism one rank's failure can arrive steps
            # before vLLM reports the load finished (on the last rank): keep
            # it on the request until then.
            for req_id in meta.loads_failed:
                state = self._reqs.get(req_id)
                if state is not None:
                    state.load.failed = True
            self._layered_workers += meta.layered_workers
            self._layered_read_workers += meta.layered_read_workers
            self._layered_peer_workers += meta.layered_peer_workers
            self._layered_done.update(meta.loads_done)
            for req_id, n in list(self._layered_done.items()):
                state = self._reqs.get(req_id)
                if state is not None and req_id in meta.layered_waits:
                    state.load.wait_s = max(state.load.wait_s, meta.layered_waits[req_id])
                if n >= self.info.num_workers:
                    del self._layered_done[req_id]
                    if state is not None and state.load.in_flight():
                        self._finish_load(state)
            for req_id, landed in meta.loads_cut:
                state = self._reqs.get(req_id)
                if state is not None:
                    cut = state.load.cut
                    state.load.cut = landed if cut is None else min(cut, landed)
        for req_id in output.finished_recving or ():
            self._fetch_queue.pop(req_id, None)
            state = self._reqs.get(req_id)
            if state is None or not state.load.in_flight():
                continue
            self._finish_load(state)
        self.stats.add(
            "host_evictions", (self.host.evictions - self._evictions_seen) * self.page_blocks
        )
        self._evictions_seen = self.host.evictions
        self._update_gauges()

    def _layered_load(self, req_id: str) -> bool:
        state = self._reqs.get(req_id)
        return state is not None and state.load.layered

    def _store_counts(self, tier: str, rank: int, counts: dict[str, int]) -> None:
        """A store's own counts (TierStore.counts) into the metrics: the
        pool's peer-directory entries (running totals: what grew since the
        rank's last report), whether the kvbm-pool the pool tier is attached
        to answers (0 if any rank's does not), the peer tier's quarantined
        landing slots (the fullest rank's)."""
        last = self._tier_counts.get((tier, rank), {})
        self._tier_counts[(tier, rank)] = counts
        if tier == "pool":
            for result in ("written", "deleted", "dropped", "failed"):
                grew = counts.get(result, 0) - last.get(result, 0)
                if grew > 0:
                    self.stats.add("peer_directory_entries", grew, result)
            ups = [c["up"] for (t, _), c in self._tier_counts.items() if t == "pool" and "up" in c]
            if ups:
                self.stats.set_gauge("tier_up", min(ups), "pool")
        elif tier == "peer":
            self.stats.set_gauge(
                "peer_quarantined_slots",
                max(
                    c.get("quarantined", 0)
                    for (t, _), c in self._tier_counts.items()
                    if t == "peer"
                ),
            )

    def _update_gauges(self) -> None:
        used = self.host.used_slots
        self.stats.set_gauge("host_cache_used_blocks", used * self.page_blocks)
        self.stats.set_gauge("host_cache_used_bytes", used * self.info.page_bytes)
        self.lower.report_links(self.stats)
