"""Load: the jobs that onboard a request's hit into its engine blocks, and
what their completion (or failure, or cut) means for the tiers and for
load_split's costs, which also learns from timing each prompt's prefill."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vllm_kvbm.keys import PageKey
from vllm_kvbm.messages import SKIP, STREAM, TransferJob
from vllm_kvbm.scheduler.request_state import _ReqState, _preemptions

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


class LoadPlanning:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): loads."""

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
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
        keys = state.chain.keys[start : start + count]
        block_ids = blocks.get_block_ids()[self.info.primary][start * g : (start + count) * g]
        if skip:  # vLLM's own cache has the first page's first blocks
            block_ids[:skip] = [SKIP] * skip
        sources = state.lookup.hit_sources[:count]
        assert len(keys) == len(sources) == count and len(block_ids) == count * g
        if self.groups is not None:
            units = self.groups.load_units(
                state.chain.keys, start, start + count, local, blocks.get_block_ids()
            )
            tiers = state.lookup.group_sources
            if units is None or any((u.page, u.group) not in tiers for u in units):
                self._refuse_load(state, block_ids, count)
                return
            keys = keys + [u.key for u in units]
            sources = sources + [tiers[(u.page, u.group)] for u in units]
            block_ids = block_ids + [b for u in units for b in u.blocks]
        # Pin the host hits first, so promotions below cannot evict them.
        host_keys = [k for k, src in zip(keys, sources) if src == "host"]
        host_slots = iter(self.host.pin(host_keys))
        job = TransferJob(
            next(self._job_ids),
            request.request_id,
            block_ids,
            [],
            adapter=state.adapter,
            peer=(state.lookup.peer or state.params.peer or "") if "peer" in sources else "",
        )
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
                if i < count:  # a primary page: the prefix's
                    self.events.describe(request, state.chain.keys, [start + i])
            job.slots.append(slot)
            job.fetch.append((i, src, key))
        job.layered = state.load.layered = state.lookup.layered
        state.load.peer = job.peer
        if job.layered and state.load.streamed:
            # vLLM was told the load is synchronous, but a page found no host
            # slot to be read into layer by layer: failed unread (recomputed).
            job.refuse = True
        state.load.keys = host_keys
        state.load.page_keys, state.load.sources = keys, sources
        lower = Counter(src for src in sources if src != "host")
        state.load.ahead = self._fetches_ahead() if lower else {}
        if lower and not job.layered:  # a layered one is read during its step
            self._fetch_queue[request.request_id] = lower
        if job.fetch and not state.load.streamed and self.groups is None:
            # (a hybrid's load is never cut: its group pages are not a prefix)
            job.recompute_s = self._recompute_seconds(start, count)
        state.load.started, state.load.tier_pages = self.split.clock(), Counter(sources)
        state.load.block_count = len(block_ids) - block_ids.count(SKIP)
        # The loaded pages are in the host tier now: never store them again.
        state.store.cursor = max(state.store.cursor, start + count)
        self._loads.append(job)

    def _refuse_load(self, state: _ReqState, block_ids: list[int], count: int) -> None:
        """A hybrid hit whose blocks vLLM allocated otherwise than its lookup
        found: a load the worker fails without copying, so vLLM recomputes."""
        state.load.started, state.load.block_count = self.split.clock(), count
        state.load.sources = []
        self._loads.append(
            TransferJob(
                next(self._job_ids), state.request.request_id, block_ids, [0] * count, refuse=True
            )
        )

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

    def _finish_load(self, state: _ReqState) -> None:
        """Its load finished on every rank (vLLM's finished_recving)."""
        keys, state.load.keys = state.load.keys, []
        promoted, state.load.promoted = state.load.promoted, []
        streamed, state.load.streamed = state.load.streamed, []
        self.host.unpin(keys)
        failed, state.load.failed = state.load.failed, False
        cut, state.load.cut = state.load.cut, None
        layered, state.load.layered = state.load.layered, False
        if cut is not None and not failed:
            self._finish_cut_load(state, keys, promoted, cut)
        elif failed:
            self._peers_read.pop(state.load.peer, None)  # its next hit loads before its step
            # The bytes may be bad: forget them rather than serve them again.
            for key in keys + [k for k, _ in promoted]:
                self.host.drop(key)
            self.stats.add("load_error_blocks", state.load.block_count)
            # vLLM recomputes these blocks: store them again once it has.
            state.store.cursor = min(
                state.store.cursor, state.lookup.local_hit_blocks // self.page_blocks
            )
            self._watched[state.request.request_id] = state
            state.lookup.recompute_only = True
            state.lookup.failed_at_preemption = _preemptions(state.request)
        else:
            if layered:
                # Copied during the step that computed the request: what it
                # cost is the forward pass's waits, not the time to this
                # report; nothing for load_split to learn.
                self.stats.observe("load_latency_seconds", [state.load.wait_s])
                self.stats.add("onboard_layered_blocks", state.load.block_count)
                state.load.tier_pages, state.load.wait_s = None, 0.0
            else:
                self.stats.observe(
                    "load_latency_seconds", [self.split.clock() - state.load.started]
                )
                self._learn_load(state)
            self.stats.add("onboard_blocks_h2d", state.load.block_count)
            self.host.commit([key for key, _ in promoted])  # now in the host tier
            fetched = Counter(streamed)
            fetched.update(tier for _, tier in promoted)
            for tier, pages in fetched.items():
                self.stats.add(self.lower.onboard_counter(tier), pages)
            if "peer" in fetched:
                self._peer_read(state.load.peer)
            self._spill(keys, reused=True)
        self._maybe_forget(state)

    def _finish_cut_load(
        self, state: _ReqState, keys: list[PageKey], promoted: list[tuple[PageKey, str]], cut: int
    ) -> None:
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
            self.stats.add(self.lower.onboard_counter(tier), pages)
        self.stats.add("recompute_chosen_tokens", (len(load.page_keys) - cut) * self.page_tokens)
        self.stats.add("onboard_blocks_h2d", cut * self.page_blocks)
        # What the cut says of the tier: the whole load at the pace its
        # landed pages came (with none landed, at least the time waited for
        # each page), so the next request's split sees what it would cost.
        elapsed = self.split.clock() - load.started
        self.stats.observe("load_latency_seconds", [elapsed])
        lower = Counter(t for t in load.sources if t != "host")
        if load.tier_pages is not None and len(lower) == 1:
            [(tier, pages)] = lower.items()
            got = sum(1 for t in load.sources[:cut] if t == tier)
            self.split.load_done(Counter({tier: pages}), elapsed * pages / max(got, 1), load.ahead)
            self.stats.set_gauge(
                f"load_seconds_per_block_{tier}",
                self.split.seconds_per_block(tier) / self.page_blocks,
            )
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
            self.stats.set_gauge(
                f"load_seconds_per_block_{tier}",
                self.split.seconds_per_block(tier) / self.page_blocks,
            )

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
        self.stats.set_gauge(
            "recompute_seconds_per_block", self.split.prefill.block_seconds(0, self.block_size)
        )
