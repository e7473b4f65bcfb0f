"""Lookup: how much of a request's prompt beyond vLLM's own hit the tiers
hold, and counting what was found once vLLM admits the request."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vllm_kvbm.keys import group_key
from vllm_kvbm.scheduler.request_state import _ReqState, _preemptions

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Pages one background lookup asks about at most (64k tokens at 16 tokens a
# page): a hit from the tiers behind a server is at most this long.
_BACKGROUND_RUN = 4096

# A hit's disk and peer pages are read during the step that computes it
# (layer by layer, worker/layer_reads.py) only up to this many bytes and
# pages a step (each page file is open for the step, each peer page holds a
# header landing slot; the forward pass waits for the reads at most 2.5 s):
# a longer hit loads before the step.
LAYERED_READ_MAX_BYTES = 1 << 30
LAYERED_READ_MAX_PAGES = 256

# A hit with peer pages is read during its step only from a peer a load read
# from within this long (the workers' first contact with a peer, its NIXL
# metadata and UCX's connection, can take longer than a step waits; a worker
# forgets a peer idle for 300 s).
PEER_WARM_S = 120.0

# Once the lower tiers' answer is overdue, a request waits at most this share
# of what the answer could save (so a frozen server costs a newcomer about
# this much of its recompute time, not all of it); a late answer on a long
# prompt still gets that long to come.
OVERDUE_WAIT_SHARE = 0.1


class PrefixLookup:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): lookups."""

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
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
        found.peer = None
        found.split_dropped = 0
        found.layered = False
        if found.recompute_only and _preemptions(request) > found.failed_at_preemption:
            found.recompute_only = False
        if start >= max_pages or found.recompute_only or not state.params.loads:
            return 0, False
        sources = self._lookup(state, start, max_pages)
        if sources is None:
            self.held.hold(found)
            return None, False  # vLLM asks again next step
        if not self.held.may_go(found):
            return None, False  # held requests of another arrival go on in this step
        # Only the tiers and tokens the request allows (kv_load_tiers,
        # max_load_tokens), and of those the part whose load beats
        # recomputing it (learned costs).
        sources = sources[
            : state.params.loadable(
                sources, local * self.block_size - start * self.page_tokens, self.page_tokens
            )
        ]
        keep = self.split.cut(sources, start, self._fetches_ahead() if self._fetch_queue else None)
        state.lookup.split_dropped = len(sources) - keep
        sources = sources[:keep]
        if self.groups is not None and sources:
            sources = self._group_hit(state, start, sources)
            if sources is None:
                self.held.hold(found)
                return None, False  # the lower tiers' answer: next step
        state.lookup.hit_sources = sources
        hit = len(sources)
        if hit == 0:
            return 0, False
        # A hit the host tier holds whole, where every worker copies loads
        # layer by layer: synchronous, computed in this very step; one with
        # disk or peer pages too where every worker reads them layer by
        # layer (peer pages: into host slots registered for it) and the host
        # tier has a slot for each. Not while the weights are in doubt: a
        # worker would refuse it, and vLLM counts a refused synchronous
        # load's tokens as cached though it recomputes them.
        read = sum(1 for src in sources if src != "host")
        if read:  # with the layered reads of the step's loads admitted before
            read += sum(len(job.fetch) for job in self._loads if job.layered)
        found.layered = (
            self._layered_workers >= self.info.num_workers
            and self.groups is None
            and self.weights.settled
            and all(src in ("host", "disk", "peer") for src in sources)
            and ("peer" not in sources or self._peer_layered(found.peer or state.params.peer))
            and (
                not read
                or self._layered_read_workers >= self.info.num_workers
                and len(sources) <= self.host.available()  # its host hits pinned first
                and read <= LAYERED_READ_MAX_PAGES
                and read * self.info.page_bytes <= LAYERED_READ_MAX_BYTES
            )
        )
        return (start + hit) * self.page_tokens - local * self.block_size, not found.layered

    def _peer_layered(self, endpoint: str | None) -> bool:
        """Whether a hit from the peer at ``endpoint`` can be read during its
        step: every worker reads peers into its host slots in place, and a
        load from that peer succeeded lately."""
        return self._layered_peer_workers >= self.info.num_workers and self._peer_warm(endpoint)

    def _peer_warm(self, endpoint: str | None) -> bool:
        """Whether a load from the peer at ``endpoint`` succeeded lately."""
        at = self._peers_read.get(endpoint or "")
        return at is not None and self.split.clock() - at < PEER_WARM_S

    def _peer_read(self, endpoint: str) -> None:
        """A load from the peer at ``endpoint`` succeeded now."""
        now = self.split.clock()
        for old in [e for e, at in self._peers_read.items() if now - at >= PEER_WARM_S]:
            del self._peers_read[old]
        if endpoint:
            self._peers_read[endpoint] = now

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

    def _lookup_in_background(
        self, state: _ReqState, sources: list[str], i: int, end: int
    ) -> list[str] | None:
        """The rest of ``_lookup`` from block ``i`` (the first the host tier
        lacks): the lower tiers' answer comes from the background thread,
        None until it has one. Their pages are promoted into free host slots,
        or streamed past the host tier when none is free, so a hit is as
        long as the tiers hold, whatever the host tier's size."""
        n = min(end - i, _BACKGROUND_RUN)
        keys = state.chain.keys
        if len(keys) < i + n:
            state.chain.extend_to(state.request.all_token_ids, i + n)
        answer = self._background.ask_at(
            state.request.request_id, keys, i, i + n, state.params.peer
        )
        if answer is None:
            if self._waited_enough(state, i, n):
                # Goes on with what is known: the host part; the answer,
                # when it comes, serves later requests (BackgroundLookups).
                self._background.went_on(state.request.request_id)
                return sources
            return None  # asked: vLLM asks again next step
        state.lookup.waiting_since = None
        lower, offset, state.lookup.peer = answer
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

    def _group_hit(self, state: _ReqState, start: int, sources: list[str]) -> list[str] | None:
        """A hybrid model's hit: the primary group's pages ``sources`` (from
        page ``start``), cut to the longest prefix every other group can
        serve (scheduler/group_pages.py); their tiers go to
        ``lookup.group_sources``. Group pages the host tier lacks are asked
        of the lower tiers on the lookup thread: None until it answers."""
        end, keys, groups = start + len(sources), state.chain.keys, self.groups
        names = {
            (i, g.index): group_key(keys[i], g.index)
            for i in range(start, end)
            for g in groups.others
        }
        allowed = state.params.load_tiers  # kv_load_tiers (None: every tier)
        found = {
            u: "host"
            for u, key in names.items()
            if self.host.is_ready(key) and (allowed is None or "host" in allowed)
        }
        boundary = groups.longest_hit(start, end, found.__contains__)
        if boundary < end and self._background is not None:
            missing = [u for u in names if u not in found]
            # the primary pages' peer, if any: a load reads from one peer
            answer = self._background.ask_each_at(
                state.request.request_id,
                [names[u] for u in missing],
                state.lookup.peer or state.params.peer,
            )
            if answer is None:
                if not self._waited_enough(state, start, len(sources)):
                    return None
            else:
                tiers, peer = answer
                found.update(
                    (u, tier)
                    for u, tier in zip(missing, tiers)
                    if tier and (allowed is None or tier in allowed)
                )
                state.lookup.peer = state.lookup.peer or peer
                boundary = groups.longest_hit(start, end, found.__contains__)
        state.lookup.group_sources = {
            u: found[u] for u in groups.needed(start, boundary) if u in found
        }
        return sources[: boundary - start]

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
        return waited >= bound or (
            waited >= OVERDUE_WAIT_SHARE * bound
            and self._background.overdue(state.request.request_id)
        )

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
        if state is None or max_pages < 1 or not state.params.loads:
            return False
        if self.host.is_ready(self._keys(state, self.page_tokens)[0]):
            return True
        return bool(self._lookup(state, 0, max_pages))
