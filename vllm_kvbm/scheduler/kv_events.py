"""KV events for KV-aware routers: which pages each KVBM tier holds.

vLLM publishes its own KV cache events (``--kv-events-config``: ZMQ PUB,
msgpack ``KVEventBatch``) and, every step, adds whatever the connector's
``take_events()`` returns. This collects those on the scheduler side, in
vLLM's own types, named by vLLM's own block hashes (``request.block_hashes``,
converted as vLLM converts them), so a router that credits a replica for the
blocks it announced (Dynamo's KV router, llm-d's KV-cache indexer) sees the
host, disk and remote tiers beside the GPU cache:

- BlockStored when a page becomes loadable in a tier: the host tier when its
  store (or promotion from a lower tier) lands; disk and remote when every
  worker confirmed its write-through.
- BlockRemoved when it stops being: host LRU eviction, a page dropped as bad,
  a lower tier's own deletion or a failed write (the worker reports both),
  a connector reset (every host page), and keys that name other weights after
  a weights epoch (every page of every tier: its keys are never looked up
  again here). A remote store shared with other engines may also lose a page to
  another engine's writes or to the server's own eviction: KVBM cannot learn
  of that, and the page stays announced until this engine next fails to read
  it (then BlockRemoved) or its keys move.

Mediums: "CPU" for the host tier (vLLM's ``MEDIUM_CPU``, as its
OffloadingConnector names its CPU tier), "DISK" and "EXTERNAL" for the disk and
remote tiers (the names Dynamo's router maps to its Disk and External tiers,
``StorageTier::from_kv_medium``; llm-d takes the lower-cased medium as the
tier name its ``kvCacheBackendConfigs`` weigh).

Pool pages served to peers (pool_serve_port, or kvbm-pool's --serve-port)
name their holder: ``ownership`` is the rank-0 control endpoint peers read
them at (``tcp://HOST:PORT``, what a router puts in a request's
``router_hint.source_control_endpoint`` to send another engine there), on
the pool's BlockStored and BlockRemoved (vLLM's field for which offloading
tier holds a block; the workers say the endpoint once they run). Other
tiers' events, and a pool not served, carry none.

A page whose request has no vLLM block hashes covering it publishes nothing.
Memory: per host page its event's payload (hashes, parent, tokens: a
thousandth of the page's bytes or less), kept so its write-through can be
announced after the host copy is gone; per lower-tier page only its hashes,
for the removal, in a table bounded per tier (past it the oldest page is
announced as removed: a router that under-credits a replica costs a hit, one
that over-credits it costs a recompute).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_kvbm.keys import PageKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.scheduler.slot_index import SlotIndex

logger = logging.getLogger(__name__)

MEDIUM = {"host": "CPU", "pool": "CPU", "disk": "DISK", "remote": "EXTERNAL"}
# vLLM's optional ``locality`` field (vLLM >= 0.33's tiers set it): a remote
# store is shared, not this replica's own.
_LOCALITY = {"host": None, "pool": "LOCAL", "disk": "LOCAL", "remote": "REMOTE"}
# Lower-tier pages remembered per tier for their removal events.
LOWER_PAGES = 1 << 20


@dataclass(slots=True)
class _Page:
    """One page's BlockStored payload, taken while its request is alive."""

    hashes: list  # ExternalBlockHash per block
    parent: Any
    tokens: array
    lora_id: int | None
    lora_name: str | None
    extra_keys: list | None


class NoKVEvents:
    """KV events off (the default): every hook costs a call and nothing else."""

    enabled = False
    # the endpoint peers read this engine's pool at (None: not served)
    pool_owner: str | None = None

    def watch(self, host: "SlotIndex") -> None:
        pass

    def describe(self, request: "Request", keys: list[PageKey], pages) -> None:
        pass

    def spilling(self, tiers: list[str], keys: list[PageKey]) -> None:
        pass

    def lower_stored(self, stored: list[tuple[str, PageKey]]) -> None:
        pass

    def lower_removed(self, tier: str, key: PageKey) -> None:
        pass

    def host_cleared(self) -> None:
        pass

    def keys_moved(self) -> None:
        pass

    def take(self) -> list:
        return []


class KVEvents(NoKVEvents):
    enabled = True

    def __init__(
        self,
        block_size: int,
        page_blocks: int,
        num_workers: int,
        lower_pages: int = LOWER_PAGES,
        group_idx: int = 0,
    ):
        from vllm.distributed import kv_events as ev
        from vllm.v1.core import kv_cache_utils as kcu

        self._ev, self._kcu = ev, kcu
        self.block_size, self.page_blocks = block_size, page_blocks
        self.num_workers = num_workers
        self.lower_pages = lower_pages
        # the KV cache group the events name: a hybrid model's pages are
        # announced as its first full-attention group's (the prefix's)
        self.group_idx = group_idx
        # fields this vLLM's event types have (0.32 to 0.34 differ)
        self._stored_fields = set(ev.BlockStored.__struct_fields__)
        self._removed_fields = set(ev.BlockRemoved.__struct_fields__)
        # key -> (request, page index): stores and promotions not landed yet
        self._pending: dict[PageKey, tuple[Request, int]] = {}
        self._host: dict[PageKey, _Page] = {}  # announced in the host tier
        # (tier, key) -> [page, workers that confirmed]: writes in flight
        self._writing: dict[tuple[str, PageKey], list] = {}
        # tier -> key -> hashes: announced in that tier (oldest first)
        self._lower: dict[str, OrderedDict] = {}
        self._events: list = []

    # ---- hooks --------------------------------------------------------------

    def watch(self, host: "SlotIndex") -> None:
        host.on_ready = self._host_ready
        host.on_removed = self._host_removed

    def describe(self, request: "Request", keys: list[PageKey], pages) -> None:
        """Pages ``pages`` of ``request`` (keys ``keys[p]``) are being stored
        or promoted into the host tier: announced when they land."""
        covered = len(request.block_hashes) // self.page_blocks
        for p in pages:
            if p < covered:
                self._pending[keys[p]] = (request, p)

    def spilling(self, tiers: list[str], keys: list[PageKey]) -> None:
        """Host pages ``keys`` are being written to ``tiers``."""
        for key in keys:
            page = self._host.get(key)
            if page is not None:
                for tier in tiers:
                    self._writing[(tier, key)] = [page, 0]

    def lower_stored(self, stored: list[tuple[str, PageKey]]) -> None:
        """Workers confirmed these writes (one entry per worker)."""
        for tier, key in stored:
            writing = self._writing.get((tier, key))
            if writing is None:
                continue
            writing[1] += 1
            if writing[1] < self.num_workers:
                continue  # other TP ranks still writing their shard
            del self._writing[(tier, key)]
            pages = self._lower.setdefault(tier, OrderedDict())
            if key in pages:
                pages.move_to_end(key)
                continue
            page = writing[0]
            pages[key] = page.hashes
            self._stored(page, tier)
            if len(pages) > self.lower_pages:
                _, hashes = pages.popitem(last=False)
                self._removed(hashes, tier)

    def lower_removed(self, tier: str, key: PageKey) -> None:
        """A lower tier lost the page, or its write failed or was dropped."""
        self._writing.pop((tier, key), None)
        hashes = self._lower.get(tier, {}).pop(key, None)
        if hashes is not None:
            self._removed(hashes, tier)

    def host_cleared(self) -> None:
        """A connector reset: the host tier is cleared (pages still being
        read go when their readers finish) and its stores in flight never
        land. Disk and remote pages stay announced: the keys still name the
        weights they were stored under."""
        for page in self._host.values():
            self._removed(page.hashes, "host")
        self._host.clear()
        self._pending.clear()

    def keys_moved(self) -> None:
        """The keys name other weights now: no page of any tier stored
        before is looked up again by this engine, so each is announced
        removed."""
        self.host_cleared()
        for tier, pages in self._lower.items():
            for hashes in pages.values():
                self._removed(hashes, tier)
        self._writing.clear()
        self._lower.clear()

    def take(self) -> list:
        events, self._events = self._events, []
        return events

    # ---- host tier (SlotIndex callbacks) --------------------------------------

    def _host_ready(self, keys: list[PageKey]) -> None:
        for key in keys:
            described = self._pending.pop(key, None)
            if described is None:
                continue
            page = self._page(*described)
            if page is not None:
                self._host[key] = page
                self._stored(page, "host")

    def _host_removed(self, key: PageKey) -> None:
        self._pending.pop(key, None)
        page = self._host.pop(key, None)
        if page is not None:
            self._removed(page.hashes, "host")

    # ---- events ---------------------------------------------------------------

    def _page(self, request: "Request", p: int) -> _Page | None:
        g, bs = self.page_blocks, self.block_size
        raw = request.block_hashes[p * g : (p + 1) * g]
        if len(raw) != g or any(h is None for h in raw):
            return None
        convert = self._kcu.maybe_convert_block_hash
        parent = convert(request.block_hashes[p * g - 1]) if p > 0 else None
        start = p * g * bs
        lora = request.lora_request
        return _Page(
            [convert(h) for h in raw],
            parent,
            array("q", request.all_token_ids[start : start + g * bs]),
            lora.adapter_id if lora else None,
            lora.name if lora else None,
            self._extra_keys(request, start),
        )

    def _extra_keys(self, request: "Request", start: int) -> list | None:
        """Per block, what vLLM's hash mixed in besides tokens (LoRA name,
        cache salt on the first block), as vLLM's own events carry it."""
        make = getattr(self._kcu, "generate_block_hash_extra_keys", None)
        to_event = getattr(self._kcu, "to_event_extra_keys", None)
        if make is None or to_event is None:
            return None
        bs, keys = self.block_size, []
        for b in range(self.page_blocks):
            extra, _ = make(request, start + b * bs, start + (b + 1) * bs, 0)
            keys.append(extra)
        return to_event(keys) if any(k is not None for k in keys) else None

    def _stored(self, page: _Page, tier: str) -> None:
        medium = MEDIUM[tier]
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, self._ev.BlockStored)
            and last.medium == medium
            and getattr(last, "locality", None) == self._locality(tier)
            and getattr(last, "ownership", None) == self._owner(tier, self._stored_fields)
            and page.parent is not None
            and last.block_hashes[-1] == page.parent
            and last.lora_name == page.lora_name
        ):
            # the next page of the same prompt: one event, as vLLM makes one
            # per newly cached run of blocks
            if last.extra_keys is not None or page.extra_keys is not None:
                last.extra_keys = (last.extra_keys or [None] * len(last.block_hashes)) + (
                    page.extra_keys or [None] * len(page.hashes)
                )
            last.block_hashes.extend(page.hashes)
            last.token_ids.extend(page.tokens)
            return
        fields = dict(
            block_hashes=list(page.hashes),
            parent_block_hash=page.parent,
            token_ids=page.tokens.tolist(),
            block_size=self.block_size,
            lora_id=page.lora_id,
            medium=medium,
            lora_name=page.lora_name,
            extra_keys=list(page.extra_keys) if page.extra_keys else None,
            group_idx=self.group_idx,
            locality=_LOCALITY[tier],
            ownership=self._owner(tier, self._stored_fields),
        )
        self._events.append(
            self._ev.BlockStored(**{k: v for k, v in fields.items() if k in self._stored_fields})
        )

    def _locality(self, tier: str) -> str | None:
        """The locality an event of ``tier`` carries (None where this vLLM's
        events have no such field): the host tier and the pool share the
        medium CPU, and are not merged into one event."""
        return _LOCALITY[tier] if "locality" in self._stored_fields else None

    def _owner(self, tier: str, fields: set) -> str | None:
        """The ownership an event of ``tier`` carries: the pool's endpoint."""
        return self.pool_owner if tier == "pool" and "ownership" in fields else None

    def _removed(self, hashes: list, tier: str) -> None:
        medium = MEDIUM[tier]
        last = self._events[-1] if self._events else None
        owner = self._owner(tier, self._removed_fields)
        if (
            isinstance(last, self._ev.BlockRemoved)
            and last.medium == medium
            and getattr(last, "locality", None) == self._locality(tier)
            and getattr(last, "ownership", None) == owner
        ):
            last.block_hashes.extend(hashes)
            return
        fields = dict(
            block_hashes=list(hashes),
            medium=medium,
            group_idx=self.group_idx,
            locality=_LOCALITY[tier],
            ownership=owner,
        )
        self._events.append(
            self._ev.BlockRemoved(**{k: v for k, v in fields.items() if k in self._removed_fields})
        )


def kv_events(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", info: "EngineInfo"
) -> NoKVEvents:
    """KVEvents when vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``), else the no-op."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return NoKVEvents()
    try:
        from vllm.v1.core import kv_cache_utils as kcu

        _, hash_block_size = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    except Exception as err:  # noqa: BLE001 - a vLLM without it: say so, publish nothing
        logger.warning(
            "KVBM: no KV events for the host, disk and remote tiers: this vLLM's "
            "block hashing is not the one checked (%s)",
            err,
        )
        return NoKVEvents()
    if hash_block_size != info.block_size:
        logger.warning(
            "KVBM: no KV events for the host, disk and remote tiers: vLLM hashes "
            "blocks of %d tokens, its KV cache blocks are %d (set --block-size "
            "and the hash block size alike)",
            hash_block_size,
            info.block_size,
        )
        return NoKVEvents()
    logger.info(
        "KVBM: KV events on: host, disk and remote pages published with mediums %s",
        ", ".join(f"{t}={m}" for t, m in MEDIUM.items()),
    )
    return KVEvents(info.block_size, info.page_blocks, info.num_workers, group_idx=info.primary)
