"""Scheduler side of the connector: what each tier holds, what to load and store.

Runs in vLLM's scheduler process. It never touches KV bytes: it decides, per
engine step, which engine blocks are loaded from which host slots and which
freshly computed blocks are stored into which slots, and hands those jobs to
the worker side in the connector metadata.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from vllm_kvbm.messages import KVBMConnectorMetadata, SpillJob, TransferJob
from vllm_kvbm.metrics import KVBMStats
from vllm_kvbm.scheduler.cache_reset import CacheReset
from vllm_kvbm.scheduler.group_pages import GroupPages
from vllm_kvbm.scheduler.held_requests import HeldRequests
from vllm_kvbm.scheduler.key_source import VllmBlockHashes
from vllm_kvbm.scheduler.kv_events import NoKVEvents
from vllm_kvbm.scheduler.load_plan import LoadPlanning
from vllm_kvbm.scheduler.load_split import LoadSplit
from vllm_kvbm.scheduler.lookups import BackgroundLookups
from vllm_kvbm.scheduler.lora_adapters import LoRAAdapters
from vllm_kvbm.scheduler.prefix_lookup import PrefixLookup
from vllm_kvbm.scheduler.request_state import RequestKeys, _ReqState, _StoreJob
from vllm_kvbm.scheduler.slot_index import SlotIndex
from vllm_kvbm.scheduler.store_plan import StorePlanning
from vllm_kvbm.scheduler.tier_policy import LowerTiers
from vllm_kvbm.scheduler.weights_epochs import WeightsEpochs
from vllm_kvbm.scheduler.worker_reports import WorkerReports

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


class KVBMScheduler(
    RequestKeys, PrefixLookup, LoadPlanning, StorePlanning, WorkerReports, CacheReset
):
    """The scheduler side vLLM's connector calls: the state, and each engine
    step's metadata; each phase's methods are in the module it is named for."""

    def __init__(
        self,
        info: "EngineInfo",
        num_host_slots: int,
        offload_decode_blocks: bool = False,
        metrics_sink=None,
        lower: LowerTiers | None = None,
        load_split: bool = True,
        vllm_hashes: VllmBlockHashes | None = None,
        kv_events: NoKVEvents | None = None,
    ):
        self.info = info
        # vLLM's block hashes, when keys may come from them (key_source.py)
        self._vllm_hashes = vllm_hashes
        self.offload_decode_blocks = offload_decode_blocks
        # disk / remote tiers below the host tier (empty: host tier only)
        self.lower = lower or LowerTiers([])
        # Lower tiers are asked on a thread of their own: a slow or frozen
        # server or filesystem costs hits, never the scheduler's time.
        self._background = BackgroundLookups(self.lower) if self.lower else None
        # The requests an answer releases go on at the pace they arrived.
        self.held = HeldRequests()
        # what loading a page from each tier and recomputing it cost
        self.split = LoadSplit(info.page_tokens, enabled=load_split)
        # requests whose last prompt chunk was scheduled, awaiting their first token
        self._prefills_ending: list[_ReqState] = []
        self._spills: list[SpillJob] = []
        self._pending_spills: dict[int, list] = {}  # job id -> [keys, workers left]
        # Keys, slots and lookups are per page of page_blocks engine blocks.
        self.block_size = info.block_size
        self.page_blocks = info.page_blocks
        self.page_tokens = info.page_tokens
        self.host = SlotIndex(num_host_slots)
        # a hybrid model's pages per KV cache group (None: one group)
        self.groups = GroupPages(info) if info.hybrid else None
        # what KV-aware routers are told each tier holds (kv_events.py)
        self.events = kv_events or NoKVEvents()
        self.events.watch(self.host)
        self.stats = KVBMStats(metrics_sink)
        self.stats.declare(
            ["host"]
            + [view.name for view in self.lower.views]
            + (["peer"] if self.lower.peer_view is not None else [])
        )
        # The namespace's seed, and the keys' seed: that one as the weights
        # the workers run derive it (the same on every engine they run on)
        self._base_seed = info.key_namespace.seed()
        self.weights = WeightsEpochs(info.num_workers)
        self._seed = self._base_seed
        self._reqs: dict[str, _ReqState] = {}
        # Requests a step may still concern (prompt not computed or not
        # stored): the others (decoding, prompt stored) cost a step nothing.
        self._watched: dict[str, _ReqState] = {}
        self._store_jobs: dict[int, _StoreJob] = {}
        self._job_ids = itertools.count()
        self._loads: list[TransferJob] = []
        # workers that copy loads layer by layer (worker_reports.py), those
        # that read disk hits so too, and per request how many finished its
        # layered load
        self._layered_workers = 0
        self._layered_read_workers = 0
        self._layered_peer_workers = 0
        # when a load from each peer (its endpoint) last succeeded: a peer
        # hit is read during its step only from a peer the workers reach now
        self._peers_read: dict[str, float] = {}
        self._layered_done: Counter = Counter()
        # lower-tier pages per tier of each request's load in flight: what a
        # new load queues behind on the tiers' read threads (load_split)
        self._fetch_queue: dict[str, Counter] = {}
        self._delayed_free: list[str] = []
        # requests with a store backlog (their pages wait for host slots)
        self._backlogged: dict[str, _ReqState] = {}
        self._kv_cache_manager: KVCacheManager | None = None
        self.adapters = LoRAAdapters(self._stop_storing)
        self._evictions_seen = 0
        # tier -> TP rank -> (used, capacity) bytes the rank's store last reported
        self._tier_usage: defaultdict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
        self.stats.set_gauge("host_cache_capacity_blocks", num_host_slots * info.page_blocks)
        self.stats.set_gauge("host_cache_capacity_bytes", num_host_slots * info.page_bytes)
        self.stats.set_gauge("page_size_blocks", info.page_blocks)
        self.stats.set_gauge("peer_quarantined_slots", 0)
        # (tier, TP rank) -> a store's own counts last reported (TierStore.counts)
        self._tier_counts: dict[tuple[str, int], dict[str, int]] = {}
        for name in [f"load_seconds_per_block_{tier}" for tier in self.stats.tiers] + [
            "recompute_seconds_per_block"
        ]:
            self.stats.set_gauge(name, 0.0)  # not learned yet
        self._update_gauges()
        logger.info(
            "KVBM scheduler: host tier of %d pages of %d tokens (%d bytes each)",
            num_host_slots,
            info.page_tokens,
            info.page_bytes,
        )

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager
        self._watch_prefix_cache_resets(manager)

    def build_connector_meta(self, out: "SchedulerOutput") -> KVBMConnectorMetadata:
        self.held.next_step()
        self._spill_checked()
        # Preempted requests first: vLLM freed their blocks in this schedule
        # (and may have handed them out), so no backlog of theirs is drained.
        flush = self._preempted(out.preempted_req_ids or ())
        backlog_stores = self._drain_backlogs()
        meta = KVBMConnectorMetadata(
            loads=self._loads,
            delayed_free_req_ids=self._delayed_free,
            spills=self._spills,
            weights=self.weights.meta(),
        )
        meta.flush_req_ids += flush
        meta.stores += backlog_stores
        self._loads, self._delayed_free, self._spills = [], [], []
        now = self.split.clock()
        self._time_prefills(now)
        watched = self._watched
        states = (
            {}
            if self.groups is None
            else self.groups.boundary_states(out, self._kv_cache_manager.get_block_ids)
        )
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            state = watched.get(req_id)
            if state is not None and num_scheduled > 0:
                self._watch_prefill(state, num_scheduled, now)
                job = self._plan_store(state, num_scheduled, states.get(req_id))
                if job is not None:
                    meta.stores.append(job)
                if self._settled(state, num_scheduled):
                    del watched[req_id]
        return meta

    def _preempted(self, req_ids) -> list[str]:
        """Requests vLLM preempted this step: watched again (they compute their
        prompt again), their backlogs dropped (their blocks are freed); those
        whose stores are in flight, which the workers finish first."""
        flush = []
        for req_id in req_ids:
            state = self._reqs.get(req_id)
            if state is not None:
                self._watched[req_id] = state
                if state.store.jobs:
                    flush.append(req_id)
                if state.store.backlog is not None:
                    self._drop_backlog(state)
        return flush

    def _settled(self, state: _ReqState, num_scheduled: int) -> bool:
        """After this step, nothing in its steps concerns the connector until
        a preemption or a failed load (which watch it again)."""
        request = state.request
        return (
            not self.offload_decode_blocks
            and request.num_computed_tokens + num_scheduled >= request.num_prompt_tokens
            and (
                state.no_store
                or state.store.cursor >= request.num_prompt_tokens // self.page_tokens
            )
        )

    def _maybe_forget(self, state: _ReqState) -> None:
        if self._background is not None and state.finished:
            self._background.forget(state.request.request_id)
        if state.finished and not (
            state.store.jobs
            or state.load.in_flight()
            or state.store.backlog is not None
            or state.store.free_pending
        ):
            self._reqs.pop(state.request.request_id, None)
            self._watched.pop(state.request.request_id, None)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        state = self._reqs.get(request.request_id)
        if state is None:
            return False, None
        state.finished = True
        if state.prefill.ending:  # finished at its first token
            self._prefills_ending = [s for s in self._prefills_ending if s is not state]
            self._prefill_sample(state, self.split.clock())
        if state.store.backlog is not None:
            # Pages still to store from these blocks: kept until they are.
            state.store.free_pending = True
            return True, None
        if state.store.jobs:
            # Stores still read these blocks: keep them until the worker says so.
            self._delayed_free.append(request.request_id)
            return True, None
        self._maybe_forget(state)
        return False, None

    def has_pending_work(self) -> bool:
        return bool(
            self._store_jobs
            or self._loads
            or self._delayed_free
            or self._spills
            or self._pending_spills
            or self._backlogged
            or (self._background is not None and self._background.checks_pending)
        )
