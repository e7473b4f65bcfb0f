"""Scheduler side of the connector: what each tier holds, what to load and store.

Runs in vLLM's scheduler process. It never touches KV bytes: it decides, per
engine step, which engine blocks are loaded from which host slots and which
freshly computed blocks are stored into which slots, and hands those jobs to
the worker side in the connector metadata.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvbm.keys import (KeyChain, PageKey, VllmHashKeys, derive_seed,
                            request_salt)
from vllm_kvbm.messages import (SKIP, STREAM, KVBMConnectorMetadata, KVBMWorkerMetadata,
                                SpillJob, TransferJob)
from vllm_kvbm.scheduler.key_source import VllmBlockHashes
from vllm_kvbm.scheduler.kv_events import NoKVEvents
from vllm_kvbm.scheduler.slot_index import SlotIndex
from vllm_kvbm.metrics import KVBMStats
from vllm_kvbm.scheduler.load_split import LoadSplit
from vllm_kvbm.scheduler.lora_adapters import LoRAAdapters, lora_identity
from vllm_kvbm.scheduler.lookups import BackgroundLookups
from vllm_kvbm.scheduler.tier_policy import LowerTiers

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

# Pages one background lookup asks about at most (64k tokens at 16 tokens a
# page): a hit from the tiers behind a server is at most this long.
_BACKGROUND_RUN = 4096

# Once the lower tiers' answer is overdue, a request waits at most this share
# of what the answer could save (so a frozen server costs a newcomer about
# this much of its recompute time, not all of it); a late answer on a long
# prompt still gets that long to come.
OVERDUE_WAIT_SHARE = 0.1

# A store backlog that gets no host slot for this long and this many steps
# is dropped (counted in store_skipped_blocks): a finished request's engine
# blocks are held for it. Steps too, as a long prefill step alone can take
# longer than the slots' round trip (store, spill, copied) of a few steps.
BACKLOG_TIMEOUT_S = 5.0
BACKLOG_TIMEOUT_STEPS = 20


@dataclass
class _Lookup:
    """What the last lookup (``get_num_new_matched_tokens``) found, read when
    vLLM allocates the request's blocks and when it admits the request."""

    # the engine blocks vLLM's own prefix cache had
    local_hit_blocks: int = 0
    # where each page of the hit lives ("host", "disk", ...), from the page
    # holding block local_hit_blocks on
    hit_sources: list[str] = field(default_factory=list)
    # tokens asked about; counted when vLLM admits the request (None: nothing
    # to count), as vLLM counts its own cache queries
    tokens: int | None = None
    # pages found but left to recompute (cheaper than loading)
    split_dropped: int = 0
    # a load of it failed: lookups find nothing until it is next preempted
    # (vLLM looks it up again when the failed block was its first, and a tier
    # that keeps failing on a page it still lists would send it round load,
    # fail, look up forever; a preemption frees its KV, and one more load may pay)
    recompute_only: bool = False
    failed_at_preemption: int = 0  # request.num_preemptions when its load failed
    # when it first waited for the lower tiers' answer (None: not waiting)
    waiting_since: float | None = None


@dataclass
class _Load:
    """The request's load in flight, from its planning to its completion."""

    # keys pinned by the load, unpinned when it finishes
    keys: list[PageKey] = field(default_factory=list)
    # keys fetched from a lower tier into fresh host slots (promotion):
    # committed to the host tier when the load succeeds
    promoted: list[tuple[PageKey, str]] = field(default_factory=list)
    # tiers of the pages streamed past the host tier (no host slot was free
    # for them): counted when the load succeeds
    streamed: list[str] = field(default_factory=list)
    # a worker reported the load failed; kept until vLLM reports the load
    # finished on every rank (possibly steps later)
    failed: bool = False
    # when it was planned, its pages per tier, its blocks (for load_split)
    started: float = 0.0
    tier_pages: Counter | None = None
    block_count: int = 0
    # the load's pages (keys and tiers), and how many landed when a worker
    # cut it for running late (None: not cut; with TP, the fewest of any rank)
    page_keys: list[PageKey] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    cut: int | None = None
    # (loads, pages) per lower tier in flight when it was planned
    ahead: dict[str, tuple[int, int]] = field(default_factory=dict)

    def in_flight(self) -> bool:
        return bool(self.keys or self.promoted or self.streamed)


@dataclass
class _StoreProgress:
    """How far the request's computed pages have been stored."""

    # pages [0, cursor) have been considered for storing
    cursor: int = 0
    jobs: set[int] = field(default_factory=set)
    # pages [backlog, cursor) are computed but found no free host slot yet
    # (None: none): stored as slots free up, so they reach the lower tiers
    backlog: int | None = None
    backlog_since: float = 0.0  # when the backlog last got a slot
    backlog_idle: int = 0  # steps since
    # finished while its backlog waited: vLLM keeps its blocks until it drains
    free_pending: bool = False


@dataclass
class _PrefillTiming:
    """The request's prefill, timed for load_split's recompute cost."""

    # (time, cached tokens) when its prompt's first chunk was scheduled
    start: tuple[float, int] | None = None
    # its last prompt chunk is scheduled: timed at its first token
    ending: bool = False


@dataclass
class _ReqState:
    """One request's scheduler state, a part per phase."""

    request: "Request"
    chain: KeyChain | VllmHashKeys
    # what besides tokens changes this request's KV (LoRA, cache salt)
    salt: bytes = b""
    # the LoRA adapter as its keys name it: (int id, fingerprint), or None
    adapter: tuple[int, str] | None = None
    lookup: _Lookup = field(default_factory=_Lookup)
    load: _Load = field(default_factory=_Load)
    store: _StoreProgress = field(default_factory=_StoreProgress)
    prefill: _PrefillTiming = field(default_factory=_PrefillTiming)
    finished: bool = False
    # holds KV its keys may not name (computed before a cache reset, or with
    # a LoRA adapter whose files changed since): never stored again
    no_store: bool = False


@dataclass
class _StoreJob:
    req_id: str
    keys: list[PageKey]
    pending_workers: int
    failed: bool = False
    # posted before a cache reset: its pages hold pre-reset KV, never serve them
    stale: bool = False


class KVBMScheduler:
    def __init__(self, info: "EngineInfo", num_host_slots: int,
                 offload_decode_blocks: bool = False, metrics_sink=None,
                 lower: LowerTiers | None = None, load_split: bool = True,
                 vllm_hashes: VllmBlockHashes | None = None, kv_events: NoKVEvents | None = None):
        self.info = info
        # vLLM's block hashes, when keys may come from them (key_source.py)
        self._vllm_hashes = vllm_hashes
        self.offload_decode_blocks = offload_decode_blocks
        # disk / remote tiers below the host tier (empty: host tier only)
        self.lower = lower or LowerTiers([])
        # Lower tiers are asked on a thread of their own: a slow or frozen
        # server or filesystem costs hits, never the scheduler's time.
        self._background = BackgroundLookups(self.lower) if self.lower else None
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
        # what KV-aware routers are told each tier holds (kv_events.py)
        self.events = kv_events or NoKVEvents()
        self.events.watch(self.host)
        self.stats = KVBMStats(metrics_sink)
        self._seed = info.key_namespace.seed()
        self._epoch = 0  # cache resets so far (each gives new keys)
        self._reqs: dict[str, _ReqState] = {}
        # Requests a step may still concern (prompt not computed or not
        # stored): the others (decoding, prompt stored) cost a step nothing.
        self._watched: dict[str, _ReqState] = {}
        self._store_jobs: dict[int, _StoreJob] = {}
        self._job_ids = itertools.count()
        self._loads: list[TransferJob] = []
        # lower-tier pages per tier of each request's load in flight: what a
        # new load queues behind on the tiers' read threads (load_split)
        self._fetch_queue: dict[str, Counter] = {}
        self._delayed_free: list[str] = []
        # requests with a store backlog (their pages wait for host slots)
        self._backlogged: dict[str, _ReqState] = {}
        self._kv_cache_manager: KVCacheManager | None = None
        self.adapters = LoRAAdapters(self._stop_storing)
        self._evictions_seen = 0
        self.stats.set_gauge("host_cache_capacity_blocks", num_host_slots * info.page_blocks)
        self.stats.set_gauge("host_cache_capacity_bytes", num_host_slots * info.page_bytes)
        for name in ("load_seconds_per_block_host", "load_seconds_per_block_disk",
                     "load_seconds_per_block_remote", "recompute_seconds_per_block"):
            self.stats.set_gauge(name, 0.0)  # not learned yet
        self._update_gauges()
        logger.info("KVBM scheduler: host tier of %d pages of %d tokens (%d bytes each)",
                    num_host_slots, info.page_tokens, info.page_bytes)

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager

    # ---- request tracking -------------------------------------------------

    def _state(self, request: "Request") -> _ReqState | None:
        state = self._reqs.get(request.request_id)
        if state is None:
            if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
                return None  # KV depends on inputs that token ids don't capture
            lora = lora_identity(request.lora_request)
            if lora is not None and not self.adapters.usable(lora):
                return None  # the weights its KV comes from are not known
            salt = request_salt(lora, request.cache_salt)
            state = _ReqState(request, self._key_chain(request, salt), salt,
                              None if lora is None else (lora.int_id, lora.fingerprint))
            self._reqs[request.request_id] = state
            self._watched[request.request_id] = state
        return state

    def _stop_storing(self, match) -> None:
        """Requests in flight whose adapter ``match`` accepts store nothing more."""
        for state in self._reqs.values():
            if state.adapter is not None and match(state.adapter):
                state.no_store = True

    def _key_chain(self, request: "Request", salt: bytes) -> KeyChain | VllmHashKeys:
        """The request's keys under the current epoch: from vLLM's block
        hashes when they qualify for it, else our own chain (keys.py)."""
        hashes = self._vllm_hashes
        if hashes is not None and hashes.covers(request):
            return VllmHashKeys(self._seed, self.page_tokens, salt, request.block_hashes,
                                hashes.algo, stride=self.page_blocks)
        return KeyChain(self._seed, self.page_tokens, salt)

    def key_chain(self, request: "Request") -> KeyChain | VllmHashKeys:
        """A fresh copy of the keys lookups and stores use for ``request``
        (computed on demand: ``extend``), e.g. to see what a prompt is stored as."""
        return self._key_chain(request, request_salt(lora_identity(request.lora_request),
                                                     request.cache_salt))

    def _keys(self, state: _ReqState, num_tokens: int) -> list[PageKey]:
        """Keys of the first ``num_tokens // page_tokens`` pages. Copies only
        when more are computed (hot paths index ``state.chain.keys`` instead)."""
        full = num_tokens // self.page_tokens
        state.chain.extend_to(state.request.all_token_ids, full)
        keys = state.chain.keys
        return keys if len(keys) == full else keys[:full]

    # ---- lookup and load --------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None:
            return 0, False
        # vLLM must compute at least one token itself to produce logits.
        max_pages = (request.num_tokens - 1) // self.page_tokens
        local = num_computed_tokens // self.block_size
        # The page holding vLLM's first missing block: its blocks vLLM has
        # are not loaded again (SKIP), the rest are.
        start = local // self.page_blocks
        found = state.lookup
        found.local_hit_blocks = local
        found.tokens = request.num_tokens - num_computed_tokens
        found.hit_sources = []
        found.split_dropped = 0
        if found.recompute_only and _preemptions(request) > found.failed_at_preemption:
            found.recompute_only = False
        if start >= max_pages or found.recompute_only:
            return 0, False
        sources = self._lookup(state, start, max_pages)
        if sources is None:
            return None, False  # vLLM asks again next step
        # Only the part whose load beats recomputing it (learned costs).
        keep = self.split.cut(sources, start, self._fetches_ahead() if self._fetch_queue else None)
        state.lookup.split_dropped = len(sources) - keep
        sources = sources[:keep]
        state.lookup.hit_sources = sources
        hit = len(sources)
        if hit == 0:
            return 0, False
        return (start + hit) * self.page_tokens - local * self.block_size, True

    def _lookup(self, state: _ReqState, start: int, end: int) -> list[str] | None:
        """Tier of each page of the longest prefix of pages [start, end)
        held across all tiers; None when the next block is being stored or
        promoted into the host tier right now (by another request, or this
        one before a preemption): waiting a step for it beats computing it
        again; None too while the lower tiers have not answered yet.

        Keys of our SHA-256 chain are computed as the prefix goes (the chain
        up to ``start`` first, then doubling the hit so far), so a miss costs
        few hashes, not the whole prompt's; keys from vLLM's hashes (an XOR
        each) are derived for the whole range at once. From the first block the host tier lacks, the disk and
        remote tiers are asked on a thread of their own (``BackgroundLookups``):
        a server, or a disk on a network filesystem, costs hits, never the
        scheduler's time.
        """
        chain, tokens = state.chain, state.request.all_token_ids
        keys = chain.keys  # grows in place
        i = start
        while i < end:
            if i >= len(keys):
                chain.extend_to(tokens, end if chain.cheap else min(end, i + max(1, i - start)))
            i += self.host.ready_run(keys, i, min(end, len(keys)))
            if i == end or i == len(keys):
                continue  # all ready so far: hash further
            if keys[i] in self.host:
                return None  # being stored or promoted: ready within a few steps
            if self._background is not None:
                return self._lookup_in_background(state, ["host"] * (i - start), i, end)
            break
        return ["host"] * (i - start)

    def _lookup_in_background(self, state: _ReqState, sources: list[str], i: int,
                              end: int) -> list[str] | None:
        """The rest of ``_lookup`` from block ``i`` (the first the host tier
        lacks): the lower tiers' answer comes from the background thread,
        None until it has one. Their pages are promoted into free host slots,
        or streamed past the host tier when none is free, so a hit is as
        long as the tiers hold, whatever the host tier's size."""
        n = min(end - i, _BACKGROUND_RUN)
        keys = state.chain.keys
        if len(keys) < i + n:
            state.chain.extend_to(state.request.all_token_ids, i + n)
        answer = self._background.ask(state.request.request_id, keys, i, i + n)
        if answer is None:
            if self._waited_enough(state, i, n):
                # Goes on with what is known: the host part; the answer,
                # when it comes, serves later requests (BackgroundLookups).
                self._background.went_on(state.request.request_id)
                return sources
            return None  # asked: vLLM asks again next step
        state.lookup.waiting_since = None
        lower, offset = answer
        for j in range(i, i + n):
            key = keys[j]
            if self.host.is_ready(key):
                sources.append("host")
                continue
            if key in self.host:
                return None
            if offset + j - i >= len(lower):
                break
            sources.append(lower[offset + j - i])
        return sources

    def _waited_enough(self, state: _ReqState, i: int, n: int) -> bool:
        """Whether the request has waited for the lower tiers' answer about
        pages [i, i+n) as long as that answer could save it (recomputing
        those pages), or, once the answer is overdue (the lookup thread is
        stuck in a call into a tier: a frozen server, a hung mount), a share
        of that (``OVERDUE_WAIT_SHARE``). The wait counts from the request's
        own first ask, so requests held by one slow answer leave at their own
        times, not together when it comes."""
        now = self.split.clock()
        if state.lookup.waiting_since is None:
            state.lookup.waiting_since = now
        bound = self.split.wait_bound(i, n)
        if bound is None:
            return False
        waited = now - state.lookup.waiting_since
        return waited >= bound or (waited >= OVERDUE_WAIT_SHARE * bound
                                   and self._background.overdue(state.request.request_id))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        if self._background is not None:
            self._background.forget(request.request_id)  # admitted: the answer is used
        state.lookup.waiting_since = None
        g, local = self.page_blocks, state.lookup.local_hit_blocks
        start, skip = local // g, local % g
        count = (skip * self.block_size + num_external_tokens) // self.page_tokens  # pages
        self._count_lookup(state, num_external_tokens)
        if num_external_tokens == 0:
            return
        keys = state.chain.keys[start:start + count]
        block_ids = blocks.get_block_ids()[0][start * g:(start + count) * g]
        if skip:  # vLLM's own cache has the first page's first blocks
            block_ids[:skip] = [SKIP] * skip
        sources = state.lookup.hit_sources[:count]
        assert len(keys) == len(sources) == count and len(block_ids) == count * g
        # Pin the host hits first, so promotions below cannot evict them.
        host_keys = [k for k, src in zip(keys, sources) if src == "host"]
        host_slots = iter(self.host.pin(host_keys))
        job = TransferJob(next(self._job_ids), request.request_id, block_ids, [],
                          adapter=state.adapter)
        for i, (key, src) in enumerate(zip(keys, sources)):
            if src == "host":
                job.slots.append(next(host_slots))
                continue
            slot = self.host.allocate(key) if key not in self.host else None
            if slot is None:
                # No host slot free (or another request promotes this block
                # right now): the worker streams it past the host tier.
                slot = STREAM
                state.load.streamed.append(src)
            else:
                state.load.promoted.append((key, src))
                self.events.describe(request, state.chain.keys, [start + i])
            job.slots.append(slot)
            job.fetch.append((i, src, key))
        state.load.keys = host_keys
        state.load.page_keys, state.load.sources = keys, sources
        lower = Counter(src for src in sources if src != "host")
        state.load.ahead = self._fetches_ahead() if lower else {}
        if lower:
            self._fetch_queue[request.request_id] = lower
        if job.fetch and not state.load.streamed:
            job.recompute_s = self._recompute_seconds(start, count)
        state.load.started, state.load.tier_pages = self.split.clock(), Counter(sources)
        state.load.block_count = count * g - skip
        # The loaded pages are in the host tier now: never store them again.
        state.store.cursor = max(state.store.cursor, start + count)
        self._loads.append(job)

    def _fetches_ahead(self) -> dict[str, tuple[int, int]]:
        """(loads, pages) per lower tier of the loads in flight."""
        ahead: dict[str, tuple[int, int]] = {}
        for pages in self._fetch_queue.values():
            for tier, n in pages.items():
                loads, total = ahead.get(tier, (0, 0))
                ahead[tier] = (loads + 1, total + n)
        return ahead

    def _recompute_seconds(self, start: int, count: int) -> list[float]:
        """For each page i of pages [start, start+count): what recomputing
        pages i.. costs (empty while the prefill cost is not known): a worker
        cuts a fetch running later than that (tier_io.py)."""
        if not self.split.enabled or self.split.prefill.samples < 2:
            return []
        left, total = [], 0.0
        for page in range(start + count - 1, start - 1, -1):
            total += self.split.prefill.block_seconds(page, self.page_tokens)
            left.append(total)
        return left[::-1]

    def _count_lookup(self, state: _ReqState, hit_tokens: int) -> None:
        """Counts a lookup once, when vLLM admits the request with its result.

        vLLM may look a waiting request up many times before it fits, and a
        later lookup can find more (stores finished meanwhile); what counts is
        what was loaded. Resumed preempted requests are not counted again,
        matching vLLM's vllm:external_prefix_cache_{queries,hits}.
        """
        lookup, state.lookup.tokens = state.lookup.tokens, None
        if lookup is None or state.request.num_preemptions > 0:
            return
        self.stats.add("lookup_tokens", lookup)
        self.stats.add("matched_tokens", hit_tokens)
        self.stats.add("recompute_chosen_tokens", state.lookup.split_dropped * self.page_tokens)
        # Once per tier, not per page: a 32k-token hit is 2048 blocks.
        for source, tokens in self._tokens_by_source(state, hit_tokens).items():
            self.stats.add(f"matched_tokens_{source}", tokens)

    def _tokens_by_source(self, state: _ReqState, num_tokens: int) -> dict[str, int]:
        """The first ``num_tokens`` tokens of the last lookup's hit, per tier;
        fewer when the hit placed fewer (the first page's blocks vLLM had
        are not the hit's)."""
        sources, page = state.lookup.hit_sources, self.page_tokens
        skip = (state.lookup.local_hit_blocks % self.page_blocks) * self.block_size
        n = min(len(sources), -(-(num_tokens + skip) // page))
        if n == 0:
            return {}
        split = {tier: k * page for tier, k in Counter(sources[:n]).items()}
        split[sources[0]] -= skip
        split[sources[n - 1]] -= max(0, n * page - skip - num_tokens)
        return {tier: tokens for tier, tokens in split.items() if tokens > 0}

    def hit_sources(self, request: "Request", num_tokens: int) -> dict[str, int]:
        """The admitted hit's tokens per tier ("host", "disk", "remote"), for
        vLLM's per-source prefix-cache metrics (vLLM asks right after
        update_state_after_alloc). Sums to ``num_tokens``; tokens the last
        lookup did not place (none, unless vLLM admitted more than it found)
        are under "unknown"."""
        state = self._reqs.get(request.request_id)
        split = self._tokens_by_source(state, num_tokens) if state else {}
        rest = num_tokens - sum(split.values())
        if rest:
            split["unknown"] = rest
        return split

    def may_load_async(self, request: "Request") -> bool:
        """A cheap guess (vLLM >= 0.34 asks when a request is queued) whether its
        lookup will return an asynchronous load: its first page is ready in
        the host tier, or the lower tiers' answer says they hold it. That
        answer comes from the lookup thread (no stat or round trip here):
        until it is in, False; it then serves the request's lookups too."""
        state = self._state(request)
        max_pages = (request.num_tokens - 1) // self.page_tokens
        if state is None or max_pages < 1:
            return False
        if self.host.is_ready(self._keys(state, self.page_tokens)[0]):
            return True
        return bool(self._lookup(state, 0, max_pages))

    # ---- per-step metadata ------------------------------------------------

    def build_connector_meta(self, out: "SchedulerOutput") -> KVBMConnectorMetadata:
        self._spill_checked()
        backlog_stores = self._drain_backlogs()
        meta = KVBMConnectorMetadata(loads=self._loads,
                                     delayed_free_req_ids=self._delayed_free,
                                     spills=self._spills)
        meta.stores += backlog_stores
        self._loads, self._delayed_free, self._spills = [], [], []
        now = self.split.clock()
        self._time_prefills(now)
        watched = self._watched
        for req_id in out.preempted_req_ids or ():
            state = self._reqs.get(req_id)
            if state is not None:
                watched[req_id] = state  # computes its prompt again
                if state.store.jobs:
                    meta.flush_req_ids.append(req_id)
                if state.store.backlog is not None:  # its blocks are freed
                    self._drop_backlog(state)
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            state = watched.get(req_id)
            if state is not None and num_scheduled > 0:
                self._watch_prefill(state, num_scheduled, now)
                job = self._plan_store(state, num_scheduled)
                if job is not None:
                    meta.stores.append(job)
                if self._settled(state, num_scheduled):
                    del watched[req_id]
        return meta

    def _settled(self, state: _ReqState, num_scheduled: int) -> bool:
        """After this step, nothing in its steps concerns the connector until
        a preemption or a failed load (which watch it again)."""
        request = state.request
        return (not self.offload_decode_blocks
                and request.num_computed_tokens + num_scheduled >= request.num_prompt_tokens
                and (state.no_store or state.store.cursor
                     >= request.num_prompt_tokens // self.page_tokens))

    def _watch_prefill(self, state: _ReqState, num_scheduled: int, now: float) -> None:
        """Notes when a request's prompt starts and ends computing (the
        recompute cost ``split`` learns)."""
        request = state.request
        computed, prompt = request.num_computed_tokens, request.num_prompt_tokens
        if computed >= prompt:
            return
        if state.prefill.start is None:
            state.prefill.start = (now, computed)
        if computed + num_scheduled >= prompt and not state.prefill.ending:
            state.prefill.ending = True
            self._prefills_ending.append(state)

    def _time_prefills(self, now: float) -> None:
        """Prompts whose first token has appeared since: one prefill sample each."""
        if not self._prefills_ending:
            return
        still = []
        for state in self._prefills_ending:
            if state.request.num_output_tokens == 0 and not state.finished:
                still.append(state)  # async scheduling: its step is still running
                continue
            self._prefill_sample(state, now)
        self._prefills_ending = still

    def _prefill_sample(self, state: _ReqState, now: float) -> None:
        start, state.prefill.start = state.prefill.start, None
        if start is None or state.request.num_preemptions > 0:
            return
        started, cached = start
        self.split.prefill_done(cached, state.request.num_prompt_tokens - cached, now - started)
        self.stats.set_gauge("recompute_seconds_per_block",
                             self.split.prefill.block_seconds(0, self.block_size))

    def _plan_store(self, state: _ReqState, num_scheduled: int) -> TransferJob | None:
        """Stores every full page this step completes that the host lacks
        (after the request's backlog)."""
        request = state.request
        if state.no_store or (not self.offload_decode_blocks and state.store.cursor
                               >= request.num_prompt_tokens // self.page_tokens):
            return None  # e.g. decoding, prompt stored: the common case, kept cheap
        # Tokens whose KV exists after this step and whose ids are known.
        end = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
        if not self.offload_decode_blocks:
            end = min(end, request.num_prompt_tokens)
        full = end // self.page_tokens
        if state.store.cursor >= full:
            return None  # no new full page: O(1), whatever the prompt's length
        # Only the new blocks are hashed and looked at (no copies of the
        # request's keys or block ids).
        state.chain.extend_to(request.all_token_ids, full)
        assert self._kv_cache_manager is not None
        start = state.store.cursor if state.store.backlog is None else state.store.backlog
        state.store.cursor = full
        return self._store_pages(state, start, full)

    def _drain_backlogs(self) -> list[TransferJob]:
        """Stores of backlogged pages, into the host slots freed since
        (spilled pages unpinned, so evictable): a prompt longer than the
        host tier reaches the lower tiers a host tier's worth at a time."""
        jobs = []
        for state in list(self._backlogged.values()):
            if state.no_store:  # e.g. its pages would get post-reset keys
                self._drop_backlog(state)
                continue
            job = self._store_pages(state, state.store.backlog, state.store.cursor)
            if job is not None:
                jobs.append(job)
        return jobs

    def _store_pages(self, state: _ReqState, start: int, full: int) -> TransferJob | None:
        """A store of pages [start, full) the host lacks, into the host slots
        free or evictable now. Pages that find none wait as the request's
        backlog when lower tiers exist (stored as slots come free, vLLM
        keeping a finished request's blocks meanwhile), else are skipped."""
        request, keys = state.request, state.chain.keys
        # Blocks the host has (stored, or being stored by another request)
        # are left out.
        positions, job_slots, stopped = self.host.allocate_missing(keys, start, full)
        self._note_backlog(state, stopped, progressed=bool(positions))
        if not positions:
            return None
        blocks = self._kv_cache_manager.get_blocks(request.request_id).blocks[0]
        job_keys = [keys[i] for i in positions]
        self.events.describe(request, keys, positions)
        g = self.page_blocks
        if g == 1:
            job_blocks = [blocks[i].block_id for i in positions]
        else:
            job_blocks = [b.block_id for i in positions for b in blocks[i * g:(i + 1) * g]]
        job_id = next(self._job_ids)
        self._store_jobs[job_id] = _StoreJob(request.request_id, job_keys,
                                             self.info.num_workers)
        state.store.jobs.add(job_id)
        return TransferJob(job_id, request.request_id, job_blocks, job_slots,
                           adapter=state.adapter)

    # ---- completions ------------------------------------------------------

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBMWorkerMetadata):
            self.stats.add("offload_bytes_d2h", meta.bytes_stored)
            self.stats.add("onboard_bytes_h2d", meta.bytes_loaded)
            self.stats.observe("offload_latency_seconds", meta.store_latencies)
            self.stats.observe("onboard_latency_seconds", meta.load_latencies)
            self.stats.add("transfer_timeouts", meta.transfers_overdue)
            # Held before the failed stores drop their keys, so those slots
            # never reach the free list while a late write may land in them.
            self.host.hold(meta.slots_held.elements())
            self._finish_stores(meta.stores_done, ok=True)
            self._finish_stores(meta.stores_failed, ok=False)
            self.host.release(meta.slots_released.elements())
            self._finish_spills(meta.spills_done)
            self.lower.record(meta.tier_events, self.stats, self.page_blocks,
                              self.info.num_workers)
            for int_id, fingerprint in meta.adapters_loaded:
                self.adapters.loaded(int_id, fingerprint)
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
            keys, state.load.keys = state.load.keys, []
            promoted, state.load.promoted = state.load.promoted, []
            streamed, state.load.streamed = state.load.streamed, []
            self.host.unpin(keys)
            failed, state.load.failed = state.load.failed, False
            cut, state.load.cut = state.load.cut, None
            if cut is not None and not failed:
                self._finish_cut_load(state, keys, promoted, cut)
            elif failed:
                # The bytes may be bad: forget them rather than serve them again.
                for key in keys + [k for k, _ in promoted]:
                    self.host.drop(key)
                self.stats.add("load_error_blocks", state.load.block_count)
                # vLLM recomputes these blocks: store them again once it has.
                state.store.cursor = min(state.store.cursor,
                                         state.lookup.local_hit_blocks // self.page_blocks)
                self._watched[req_id] = state
                state.lookup.recompute_only = True
                state.lookup.failed_at_preemption = _preemptions(state.request)
            else:
                self._learn_load(state)
                self.stats.add("onboard_blocks_h2d", state.load.block_count)
                self.host.commit([key for key, _ in promoted])  # now in the host tier
                fetched = Counter(streamed)
                fetched.update(tier for _, tier in promoted)
                for tier, pages in fetched.items():
                    self.stats.add(self.lower.onboard_counter(tier), pages * self.page_blocks)
                self._spill(keys, reused=True)
            self._maybe_forget(state)
        self.stats.add("host_evictions", self.host.evictions - self._evictions_seen)
        self._evictions_seen = self.host.evictions
        self._update_gauges()

    def _finish_cut_load(self, state: _ReqState, keys: list[PageKey],
                         promoted: list[tuple[PageKey, str]], cut: int) -> None:
        """A load cut for running late after its first ``cut`` pages: those
        are loaded and kept (promoted ones enter the host tier), vLLM
        recomputes the rest (their blocks were reported as load errors)."""
        load = state.load
        landed = set(load.page_keys[:cut])
        for key, _ in promoted:
            if key not in landed:
                self.host.drop(key)  # its slot was never filled: its reads ended
        self.host.commit([key for key, _ in promoted if key in landed])
        for tier, pages in Counter(tier for key, tier in promoted if key in landed).items():
            self.stats.add(self.lower.onboard_counter(tier), pages * self.page_blocks)
        self.stats.add("recompute_chosen_tokens", (len(load.page_keys) - cut) * self.page_tokens)
        self.stats.add("onboard_blocks_h2d", cut * self.page_blocks)
        # What the cut says of the tier: the whole load at the pace its
        # landed pages came (with none landed, at least the time waited for
        # each page), so the next request's split sees what it would cost.
        elapsed = self.split.clock() - load.started
        lower = Counter(t for t in load.sources if t != "host")
        if load.tier_pages is not None and len(lower) == 1:
            [(tier, pages)] = lower.items()
            got = sum(1 for t in load.sources[:cut] if t == tier)
            self.split.load_done(Counter({tier: pages}), elapsed * pages / max(got, 1),
                                 load.ahead)
            self.stats.set_gauge(f"load_seconds_per_block_{tier}",
                                 self.split.seconds_per_block(tier) / self.page_blocks)
        load.tier_pages = None
        start = state.lookup.local_hit_blocks // self.page_blocks
        state.store.cursor = min(state.store.cursor, start + cut)  # stored once recomputed
        self._watched[state.request.request_id] = state
        # vLLM may look it up again (its first block failed): recompute, not load again
        state.lookup.recompute_only = True
        state.lookup.failed_at_preemption = _preemptions(state.request)
        self._spill([key for key in keys if key in landed], reused=True)

    def _learn_load(self, state: _ReqState) -> None:
        if state.load.tier_pages is None:
            return
        blocks, state.load.tier_pages = state.load.tier_pages, None
        self.split.load_done(blocks, self.split.clock() - state.load.started, state.load.ahead)
        for tier in blocks:
            self.stats.set_gauge(f"load_seconds_per_block_{tier}",
                                 self.split.seconds_per_block(tier) / self.page_blocks)

    def _update_gauges(self) -> None:
        used = self.host.used_slots
        self.stats.set_gauge("host_cache_used_blocks", used * self.page_blocks)
        self.stats.set_gauge("host_cache_used_bytes", used * self.info.page_bytes)

    def _finish_stores(self, counts: Counter, ok: bool) -> None:
        for job_id, n in counts.items():
            job = self._store_jobs.get(job_id)
            if job is None:
                continue
            job.pending_workers -= n
            job.failed |= not ok
            if job.pending_workers > 0:
                continue  # other TP ranks still copying their shard
            del self._store_jobs[job_id]
            if job.failed or job.stale:
                for key in job.keys:
                    self.host.drop(key)
            else:
                self.host.commit(job.keys)
                self._spill(job.keys, reused=False)
            if job.failed:
                self.stats.add("store_errors")
            else:
                self.stats.add("offload_blocks_d2h", len(job.keys) * self.page_blocks)
            state = self._reqs.get(job.req_id)
            if state is not None:
                state.store.jobs.discard(job_id)
                self._maybe_forget(state)

    def _spill(self, keys: list[PageKey], reused: bool) -> None:
        """Write-through of ready host blocks to the lower tiers that admit
        them: one spill job per run of blocks going to the same tiers.
        Reused blocks the disk may hold already are first asked about on the
        lookup thread (a stat on a hung filesystem never blocks this one):
        spilled when it answers (``_spill_checked``)."""
        ask = self.lower.disk_unknown(keys) if reused else []
        if ask and self._background is not None:
            self._background.check_disk(ask, keys)
            return
        self._spill_now(keys, reused)

    def _spill_checked(self) -> None:
        if self._background is not None:
            for keys, on_disk in self._background.take_checked():
                self._spill_now(keys, True, on_disk)

    def _spill_now(self, keys: list[PageKey], reused: bool,
                   on_disk: set[PageKey] | frozenset = frozenset()) -> None:
        for tiers, run in self.lower.admit(keys, reused, on_disk):
            run = [key for key in run if self.host.is_ready(key)]
            if not run:
                continue
            self.events.spilling(tiers, run)
            slots = self.host.pin(run)  # held until every worker copied them
            job = SpillJob(next(self._job_ids), run, slots, tiers)
            self._pending_spills[job.job_id] = [run, self.info.num_workers]
            self._spills.append(job)

    def _finish_spills(self, counts: Counter) -> None:
        copied = []
        for job_id, n in counts.items():
            pending = self._pending_spills.get(job_id)
            if pending is None:
                continue
            pending[1] -= n
            if pending[1] <= 0:
                del self._pending_spills[job_id]
                copied += pending[0]
        self.host.unpin(copied)

    def _note_backlog(self, state: _ReqState, stopped: int, progressed: bool) -> None:
        if stopped >= state.store.cursor:
            if state.store.backlog is not None:
                state.store.backlog = None
                self._backlog_done(state)
            return
        if not (self.lower and self.lower.writes_fresh_pages()):
            # No lower tier takes them now: a later store would only evict
            # this prompt's own pages from the host tier.
            self.stats.add("store_skipped_blocks",
                           (state.store.cursor - stopped) * self.page_blocks)
            return
        now = self.split.clock()
        if state.store.backlog is None or progressed:
            state.store.backlog_since, state.store.backlog_idle = now, 0
        else:
            state.store.backlog_idle += 1
        state.store.backlog = stopped
        self._backlogged[state.request.request_id] = state
        if (now - state.store.backlog_since > BACKLOG_TIMEOUT_S
                and state.store.backlog_idle > BACKLOG_TIMEOUT_STEPS):
            self._drop_backlog(state)

    def _drop_backlog(self, state: _ReqState) -> None:
        """Its blocks are gone or it waited too long: those pages are not stored."""
        self.stats.add("store_skipped_blocks",
                       (state.store.cursor - state.store.backlog) * self.page_blocks)
        state.store.backlog = None
        self._backlog_done(state)

    def _backlog_done(self, state: _ReqState) -> None:
        self._backlogged.pop(state.request.request_id, None)
        if state.store.free_pending:  # vLLM may free its blocks once its stores land
            state.store.free_pending = False
            self._delayed_free.append(state.request.request_id)
        self._maybe_forget(state)

    def _maybe_forget(self, state: _ReqState) -> None:
        if self._background is not None and state.finished:
            self._background.forget(state.request.request_id)
        if state.finished and not (state.store.jobs or state.load.in_flight()
                                   or state.store.backlog is not None
                                   or state.store.free_pending):
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
        return bool(self._store_jobs or self._loads or self._delayed_free
                    or self._spills or self._pending_spills or self._backlogged
                    or (self._background is not None and self._background.checks_pending))

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
        self._seed = derive_seed(self._seed, "reset", os.urandom(16).hex())
        for state in self._reqs.values():
            # KV computed (or being loaded) before the reset never gets a
            # post-reset key; lookups from now on use the new epoch.
            if state.request.num_computed_tokens > 0 or state.load.in_flight():
                state.no_store = True
            else:  # computes from scratch (e.g. preempted by the reset): store it all anew
                state.store.cursor = 0
            state.chain = self._key_chain(state.request, state.salt)
        self._epoch += 1
        logger.info("KVBM: cache reset dropped %d host pages; disk and remote pages from "
                    "before it are no longer looked up (key epoch %d)", dropped, self._epoch)
        return True

    def _vllm_cache_was_reset(self) -> bool:
        """vLLM resets its prefix cache only when no block is in use but the
        null block (BlockPool.reset_prefix_cache): the same test, on the same
        thread, right after (or before) it ran."""
        manager = self._kv_cache_manager
        pool = getattr(manager, "block_pool", None)
        if pool is None:
            return True  # no vLLM cache bound: nothing of vLLM's can be stale
        return pool.num_gpu_blocks - pool.get_num_free_blocks() <= 1


def _preemptions(request: "Request") -> int:
    return getattr(request, "num_preemptions", 0)  # vLLM counts them (0.32 to 0.34)
