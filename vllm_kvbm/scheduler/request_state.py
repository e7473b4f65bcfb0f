"""One request's scheduler state (a part per phase), and its page keys.

The dataclasses are what each phase of ``KVBMScheduler`` (planner.py) keeps
per request; ``RequestKeys`` creates that state when vLLM first asks about a
request and derives its keys.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_kvbm.keys import KeyChain, PageKey, VllmHashKeys, request_salt
from vllm_kvbm.scheduler.lora_adapters import lora_identity
from vllm_kvbm.scheduler.request_params import ALL, RequestParams, for_request

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class _Lookup:
    """What the last lookup (``get_num_new_matched_tokens``) found, read when
    vLLM allocates the request's blocks and when it admits the request."""

    # the engine blocks vLLM's own prefix cache had
    local_hit_blocks: int = 0
    # where each page of the hit lives ("host", "disk", ...), from the page
    # holding block local_hit_blocks on
    hit_sources: list[str] = field(default_factory=list)
    # a hybrid model's other groups' pages of the hit: (page, group) -> tier
    group_sources: dict[tuple[int, int], str] = field(default_factory=dict)
    # the endpoint of the peer its "peer" pages are read from: the hint's, or
    # the one the peer directory named (None: no peer page)
    peer: str | None = None
    # tokens asked about; counted when vLLM admits the request (None: nothing
    # to count), as vLLM counts its own cache queries
    tokens: int | None = None
    # pages found but left to recompute (cheaper than loading)
    split_dropped: int = 0
    # told vLLM the load is synchronous: a host-tier hit the workers copy
    # layer by layer during the forward pass (worker/layer_copies.py)
    layered: bool = False
    # a load of it failed: lookups find nothing until it is next preempted
    # (vLLM looks it up again when the failed block was its first, and a tier
    # that keeps failing on a page it still lists would send it round load,
    # fail, look up forever; a preemption frees its KV, and one more load may pay)
    recompute_only: bool = False
    failed_at_preemption: int = 0  # request.num_preemptions when its load failed
    # when it first waited for the lower tiers' answer (None: not waiting)
    waiting_since: float | None = None
    # the step from which its lookup has had no answer (None: not held):
    # it goes on at the pace held requests arrived (held_requests.py)
    held_from: int | None = None


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
    # copied layer by layer in the step that computes the request, and the
    # longest a worker's forward pass waited for it
    layered: bool = False
    wait_s: float = 0.0
    # the peer its "peer" pages are read from ("": none)
    peer: str = ""

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
    # what its kv_transfer_params allow (tiers, tokens: request_params.py)
    params: RequestParams = ALL


@dataclass
class _StoreJob:
    req_id: str
    keys: list[PageKey]
    pending_workers: int
    failed: bool = False
    # posted before a cache reset: its pages hold pre-reset KV, never serve them
    stale: bool = False
    # the engine blocks it reads, held in vLLM's block pool until it is done
    pinned: list = field(default_factory=list)


class RequestKeys:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): each
    request's state and keys."""

    def _state(self, request: "Request") -> _ReqState | None:
        state = self._reqs.get(request.request_id)
        if (
            state is not None
            and (state.params.loads or state.params.stores)
            and _beyond_tokens(request)
            and not self._inputs_named(state.chain)
        ):
            # A streaming session that began as text and added an image or
            # embeddings in a later chunk, under keys that do not name them:
            # neither loads nor stores from now on.
            state.params = RequestParams(load_tiers=frozenset(), store_tiers=frozenset())
            state.no_store = True
        if state is None:
            if _mixed_embeds(request):
                return None  # never cached, whatever the keys
            lora = None
            if request.lora_request is not None:
                lora = self.adapters.cacheable(request.lora_request)
                if lora is None:  # not fingerprinted yet, or its weights are not known
                    return None
            salt = request_salt(lora, request.cache_salt)
            chain = self._key_chain(request, salt)
            if _beyond_tokens(request) and not self._inputs_named(chain):
                return None  # KV depends on inputs that these keys don't name
            state = _ReqState(
                request, chain, salt, None if lora is None else (lora.int_id, lora.fingerprint)
            )
            state.params = for_request(request)
            for part in state.params.refused:
                self.stats.add("refused_params", 1, part)
            self._reqs[request.request_id] = state
            self._watched[request.request_id] = state
        return state

    def _inputs_named(self, chain: KeyChain | VllmHashKeys) -> bool:
        """Whether ``chain``'s keys name a request's images, audio and prompt
        embeddings: vLLM's block hashes do, where they were checked to
        (key_source.py); our own chain covers token ids only."""
        return (
            isinstance(chain, VllmHashKeys)
            and self._vllm_hashes is not None
            and bool(self._vllm_hashes.inputs)
        )

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
            return VllmHashKeys(
                self._seed,
                self.page_tokens,
                salt,
                request.block_hashes,
                hashes.algo,
                stride=self.page_blocks,
            )
        return KeyChain(self._seed, self.page_tokens, salt)

    def key_chain(self, request: "Request") -> KeyChain | VllmHashKeys:
        """A fresh copy of the keys lookups and stores use for ``request``
        (computed on demand: ``extend``), e.g. to see what a prompt is stored as.
        Reads a LoRA adapter's files now: for tools and tests, not vLLM's threads."""
        return self._key_chain(
            request, request_salt(lora_identity(request.lora_request), request.cache_salt)
        )

    def _keys(self, state: _ReqState, num_tokens: int) -> list[PageKey]:
        """Keys of the first ``num_tokens // page_tokens`` pages. Copies only
        when more are computed (hot paths index ``state.chain.keys`` instead)."""
        full = num_tokens // self.page_tokens
        state.chain.extend_to(state.request.all_token_ids, full)
        keys = state.chain.keys
        return keys if len(keys) == full else keys[:full]


def _preemptions(request: "Request") -> int:
    return getattr(request, "num_preemptions", 0)  # vLLM counts them (0.32 to 0.34)


def _beyond_tokens(request: "Request") -> bool:
    """The request's KV depends on more than its token ids."""
    return bool(request.mm_features) or getattr(request, "prompt_embeds", None) is not None


def _mixed_embeds(request: "Request") -> bool:
    """Prompt embeddings interleaved with token ids (chat completions with
    embeddings): never cached, whatever the keys (not checked)."""
    return getattr(request, "prompt_is_token_ids", None) is not None
