"""The exported metrics: Prometheus names, types, help texts and labels.

The connector counts under short internal keys (``stats.add("offload_blocks_d2h")``);
this table maps each key to the Prometheus series it feeds, named by the
Prometheus conventions: the unit as the suffix (``_tokens_total``,
``_blocks_total``, ``_bytes``, ``_seconds``), and one family with a ``tier``
label where one quantity spans tiers (``kvbm_matched_tokens_total{tier="disk"}``)
instead of a name per tier; the same for other labels of bounded values
(``event``, ``param``). Related series count one unit: what moves between
the engine's KV cache and the host tier, and the host tier's capacity and
evictions, in engine blocks (vLLM's, as ``host_cache_blocks`` configures
it); what the lower tiers write, read, drop or fail, in pages, the unit they
store (``kvbm_page_size_blocks`` converts). Imports neither vLLM nor
prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("host", "pool", "disk", "peer", "remote")
LOWER_TIERS = ("pool", "disk", "peer", "remote")
# kvbm_transfer_timeouts_total's events (the worker counts them by these names)
TIMEOUT_EVENTS = ("not_started", "overdue", "no_staging_slot")
# kvbm_refused_param_requests_total's parts (request_params.RequestParams.refused)
REFUSED_PARAMS = ("load", "store", "hint", "object")
# the peer directory's lookups (DirectoryReader) and entries (DirectoryWriter)
LOOKUP_RESULTS = ("found", "missed")
ENTRY_RESULTS = ("written", "deleted", "dropped", "failed")
# The tier of a series is given where it is counted (``add(..., tier=...)``).
GIVEN = "*"

# Admitted requests the recent hit ratio covers: the most recent ones, so it
# follows the workload (Dynamo KVBM's DYN_KVBM_CACHE_STATS_MAX_REQUESTS default).
HIT_RATE_WINDOW = 1000

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Lower-tier reads and whole loads run longer than one host<->device copy.
_SLOW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Family:
    """One Prometheus metric; ``values``: those of its one label, ``label``
    (empty: it has none)."""

    name: str  # counters without the _total the client appends
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    label: str = "tier"

    @property
    def tiers(self) -> tuple[str, ...]:
        """The values of its ``tier`` label (empty: none)."""
        return self.values if self.label == "tier" else ()

    @property
    def sample(self) -> str:
        """The sample name a scrape shows (a histogram's: its ``_count``)."""
        return {"counter": f"{self.name}_total", "histogram": f"{self.name}_count"}.get(
            self.kind, self.name
        )


def _families(*families: Family) -> dict[str, Family]:
    return {f.name: f for f in families}


FAMILIES = _families(
    # -- lookups and hits: hit rates are ratios of these, summable over replicas
    Family(
        "kvbm_lookup_tokens",
        "counter",
        "Prompt tokens looked up in KVBM (beyond the engine's own prefix cache), counted "
        "once per request when vLLM admits it",
    ),
    Family(
        "kvbm_matched_tokens",
        "counter",
        "Looked-up prompt tokens found in a KVBM tier and loaded, by the tier they came from",
        TIERS,
    ),
    Family(
        "kvbm_recompute_chosen_tokens",
        "counter",
        "Prompt tokens found in a tier but recomputed on purpose: loading them was "
        "expected to take longer (learned costs, load_split)",
    ),
    Family(
        "kvbm_recent_hit_ratio",
        "gauge",
        f"Per replica: tokens found in the tier / tokens looked up, over this engine's "
        f"last {HIT_RATE_WINDOW} admitted requests (0-1; not to be summed or averaged "
        f"across replicas: divide the token counters instead)",
        TIERS,
    ),
    # -- the engine's KV cache <-> host memory
    Family(
        "kvbm_offload_blocks",
        "counter",
        "Blocks offloaded from the engine's KV cache into the host tier",
    ),
    Family(
        "kvbm_onboard_blocks",
        "counter",
        "Blocks loaded into the engine's KV cache (from any tier, through host memory)",
    ),
    Family(
        "kvbm_onboard_layered_blocks",
        "counter",
        "Blocks of host-tier hits loaded layer by layer during the step that computes the "
        "request (vLLM's CPU build with a core free of its OpenMP threads)",
    ),
    Family(
        "kvbm_offload_bytes",
        "counter",
        "Bytes offloaded from the engine's KV cache into the host tier",
    ),
    Family(
        "kvbm_onboard_bytes", "counter", "Bytes loaded from host memory into the engine's KV cache"
    ),
    Family(
        "kvbm_offload_latency_seconds",
        "histogram",
        "Time from posting an offload (device->host) transfer to its completion, per transfer",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "kvbm_onboard_latency_seconds",
        "histogram",
        "Time from posting an onboard (host->device) transfer to its completion, per transfer",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "kvbm_load_latency_seconds",
        "histogram",
        "A request's whole load, from its admission with a hit to the last block in the "
        "engine (lower-tier reads included), per load that completed",
        buckets=_SLOW_BUCKETS,
    ),
    Family(
        "kvbm_offload_skipped_blocks",
        "counter",
        "Blocks not offloaded because every host slot was in use by transfers",
    ),
    Family(
        "kvbm_offload_failed_transfers",
        "counter",
        "Offload transfers that failed (their blocks were not cached)",
    ),
    Family(
        "kvbm_onboard_failed_blocks",
        "counter",
        "Blocks whose load failed and were recomputed by vLLM",
    ),
    Family(
        "kvbm_transfer_timeouts",
        "counter",
        "Copies between the engine's KV cache and the host tier past their timeout, by "
        "event: not_started (the engine's stream never reached it within 30 s: failed, "
        "touching no memory), overdue (running after 30 s: a store is not cached and its "
        "host slots are held until the copy ends; a load keeps its request waiting), "
        "no_staging_slot (a streamed load that got no staging slot within "
        "tier_read_timeout_s: recomputed)",
        TIMEOUT_EVENTS,
        label="event",
    ),
    Family(
        "kvbm_refused_param_requests",
        "counter",
        "Requests whose kv_transfer_params KVBM refused, by the part refused: load (a "
        "load field: the request loads nothing), store (a store field: it stores "
        "nothing), hint (a peer hint: ignored), object (not an object: neither); "
        "counted when the engine first sees the request",
        REFUSED_PARAMS,
        label="param",
    ),
    # -- capacity
    Family(
        "kvbm_cache_used_blocks",
        "gauge",
        "Engine blocks held or being received, per worker",
        ("host",),
    ),
    Family("kvbm_cache_capacity_blocks", "gauge", "Capacity in engine blocks", ("host",)),
    Family(
        "kvbm_page_size_blocks",
        "gauge",
        "Engine blocks in one page (page_tokens / the engine's block size): the lower "
        "tiers count pages, the engine's KV cache and the host tier blocks",
    ),
    Family(
        "kvbm_cache_used_bytes",
        "gauge",
        "Bytes held or being received, per worker (the disk: as its LRU charges them; "
        "the pool: its file's slots holding a page, whichever engine wrote them)",
        ("host", "pool", "disk"),
    ),
    Family(
        "kvbm_cache_capacity_bytes",
        "gauge",
        "Capacity in bytes, per worker",
        ("host", "pool", "disk"),
    ),
    Family(
        "kvbm_evicted_blocks",
        "counter",
        "Engine blocks evicted (whole pages), least recently used first, to make room",
        ("host",),
    ),
    # -- the lower tiers (pool, disk, remote)
    Family(
        "kvbm_tier_read_pages",
        "counter",
        "Pages read from a lower tier for loads into the engine",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_write_pages",
        "counter",
        "Pages written from the host tier down to a lower tier (write-through)",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_read_latency_seconds",
        "histogram",
        "Time to read one load's pages from the tier (its first read call to its last), "
        "per load and worker",
        LOWER_TIERS,
        _SLOW_BUCKETS,
    ),
    Family(
        "kvbm_tier_write_latency_seconds",
        "histogram",
        "Time to write one page to the tier, per page and worker",
        LOWER_TIERS,
        _SLOW_BUCKETS,
    ),
    Family(
        "kvbm_lookup_latency_seconds",
        "histogram",
        "Time of one lookup call into the tier (one batch of page names), off vLLM's "
        "scheduler thread",
        LOWER_TIERS,
        _LATENCY_BUCKETS,
    ),
    Family(
        "kvbm_tier_write_failed_pages",
        "counter",
        "Pages the tier refused or failed to write",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_write_dropped_pages",
        "counter",
        "Pages not written because the tier's write queue was full (the tier is slower "
        "than the offload rate); written when next reused",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_read_missing_pages",
        "counter",
        "Pages expected in the tier that were gone when read",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_read_failed_pages",
        "counter",
        "Page reads that failed (I/O error, timeout, server down)",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_checksum_failed_pages",
        "counter",
        "Pages whose bytes or key did not match their checksum; removed, recomputed",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_unauthenticated_pages",
        "counter",
        "Intact pages without a valid MAC for this deployment's page secret (written "
        "without it, with another secret, or forged); removed, recomputed",
        LOWER_TIERS,
    ),
    Family(
        "kvbm_tier_up",
        "gauge",
        "1 while the tier's server answers, 0 during an outage: the remote tier's (the "
        "scheduler's link to it), the pool tier's kvbm-pool (asked by each worker attached "
        "to it every 5 s; 0 if any rank's does not)",
        ("remote", "pool"),
    ),
    Family(
        "kvbm_tier_reconnects",
        "counter",
        "Outages of the scheduler's link to the tier's server that ended (the server "
        "answered again)",
        ("remote",),
    ),
    # -- the peer tier's directory and reads (tiers/peer)
    Family(
        "kvbm_peer_directory_lookups",
        "counter",
        "Lookups in the peer directory (which live peer holds a run of pages), by result: "
        "found (it named a peer), missed (none did, or the directory did not answer)",
        LOOKUP_RESULTS,
        label="result",
    ),
    Family(
        "kvbm_peer_directory_entries",
        "counter",
        "Entries of this engine's served pool sent to the peer directory, by result: "
        "written, deleted, dropped (its queue was full), failed (the directory did not "
        "answer)",
        ENTRY_RESULTS,
        label="result",
    ),
    Family(
        "kvbm_peer_quarantined_slots",
        "gauge",
        "Landing slots of peer reads past their deadline, kept out of use until the read "
        "ends or its peer is known gone (per worker: the fullest rank's)",
    ),
    # -- what load_split learned
    Family(
        "kvbm_block_load_estimate_seconds",
        "gauge",
        "Learned time to load one block from the tier into the engine (admission to "
        "completion); 0 until learned",
        TIERS,
    ),
    Family(
        "kvbm_block_recompute_estimate_seconds",
        "gauge",
        "Learned time to recompute one block at the start of a prompt (later blocks cost "
        "more: attention); 0 until learned",
    ),
    Family(
        "kvbm_build_info", "gauge", "1, with the vllm_kvbm version serving as the version label"
    ),
)


def _per_tier(prefix: str, family: str, tiers=TIERS) -> dict[str, tuple[str, str]]:
    return {f"{prefix}{tier}": (family, tier) for tier in tiers}


# internal key -> (family, tier): tier None where the family has no tier
# label, GIVEN where the caller names it.
COUNTERS: dict[str, tuple[str, str | None]] = {
    "lookup_tokens": ("kvbm_lookup_tokens", None),
    **_per_tier("matched_tokens_", "kvbm_matched_tokens"),
    "recompute_chosen_tokens": ("kvbm_recompute_chosen_tokens", None),
    "offload_blocks_d2h": ("kvbm_offload_blocks", None),
    "onboard_blocks_h2d": ("kvbm_onboard_blocks", None),
    "onboard_layered_blocks": ("kvbm_onboard_layered_blocks", None),
    "offload_bytes_d2h": ("kvbm_offload_bytes", None),
    "onboard_bytes_h2d": ("kvbm_onboard_bytes", None),
    "store_skipped_blocks": ("kvbm_offload_skipped_blocks", None),
    "store_errors": ("kvbm_offload_failed_transfers", None),
    "load_error_blocks": ("kvbm_onboard_failed_blocks", None),
    "transfer_timeouts": ("kvbm_transfer_timeouts", GIVEN),
    "refused_params": ("kvbm_refused_param_requests", GIVEN),
    "host_evictions": ("kvbm_evicted_blocks", "host"),
    # (keys of 0.1.0, when these families counted blocks: they count pages now)
    "onboard_blocks_pool": ("kvbm_tier_read_pages", "pool"),
    "onboard_blocks_d2d": ("kvbm_tier_read_pages", "disk"),
    "onboard_blocks_peer": ("kvbm_tier_read_pages", "peer"),
    "onboard_blocks_remote": ("kvbm_tier_read_pages", "remote"),
    "offload_blocks_pool": ("kvbm_tier_write_pages", "pool"),
    "offload_blocks_h2d": ("kvbm_tier_write_pages", "disk"),
    "offload_blocks_remote": ("kvbm_tier_write_pages", "remote"),
    "tier_write_errors": ("kvbm_tier_write_failed_pages", GIVEN),
    "tier_write_drops": ("kvbm_tier_write_dropped_pages", GIVEN),
    "tier_read_misses": ("kvbm_tier_read_missing_pages", GIVEN),
    "tier_read_errors": ("kvbm_tier_read_failed_pages", GIVEN),
    "checksum_failures": ("kvbm_checksum_failed_pages", GIVEN),
    "page_auth_failures": ("kvbm_unauthenticated_pages", GIVEN),
    "tier_reconnects": ("kvbm_tier_reconnects", GIVEN),
    "peer_directory_lookups": ("kvbm_peer_directory_lookups", GIVEN),
    "peer_directory_entries": ("kvbm_peer_directory_entries", GIVEN),
}
# Internal totals that are the sum of one family over its tiers (not exported
# themselves: ``sum(kvbm_matched_tokens_total)`` is the same number).
SUMS = {"matched_tokens": "kvbm_matched_tokens"}

HISTOGRAMS: dict[str, tuple[str, str | None]] = {
    "offload_latency_seconds": ("kvbm_offload_latency_seconds", None),
    "onboard_latency_seconds": ("kvbm_onboard_latency_seconds", None),
    "load_latency_seconds": ("kvbm_load_latency_seconds", None),
    "tier_read_latency_seconds": ("kvbm_tier_read_latency_seconds", GIVEN),
    "tier_write_latency_seconds": ("kvbm_tier_write_latency_seconds", GIVEN),
    "lookup_latency_seconds": ("kvbm_lookup_latency_seconds", GIVEN),
}

GAUGES: dict[str, tuple[str, str | None]] = {
    "host_cache_used_blocks": ("kvbm_cache_used_blocks", "host"),
    "host_cache_capacity_blocks": ("kvbm_cache_capacity_blocks", "host"),
    "page_size_blocks": ("kvbm_page_size_blocks", None),
    "host_cache_used_bytes": ("kvbm_cache_used_bytes", "host"),
    "host_cache_capacity_bytes": ("kvbm_cache_capacity_bytes", "host"),
    "pool_cache_used_bytes": ("kvbm_cache_used_bytes", "pool"),
    "pool_cache_capacity_bytes": ("kvbm_cache_capacity_bytes", "pool"),
    "disk_cache_used_bytes": ("kvbm_cache_used_bytes", "disk"),
    "disk_cache_capacity_bytes": ("kvbm_cache_capacity_bytes", "disk"),
    **{f"{tier}_cache_hit_rate": ("kvbm_recent_hit_ratio", tier) for tier in TIERS},
    **_per_tier("load_seconds_per_block_", "kvbm_block_load_estimate_seconds"),
    "recompute_seconds_per_block": ("kvbm_block_recompute_estimate_seconds", None),
    "tier_up": ("kvbm_tier_up", GIVEN),
    "peer_quarantined_slots": ("kvbm_peer_quarantined_slots", None),
}

KEYS = {**COUNTERS, **HISTOGRAMS, **GAUGES}


def series_key(name: str, tier: str | None = None) -> str:
    """The key of one series in the stats payload: ``name`` or ``name@tier``."""
    family, fixed = KEYS[name]
    if fixed == GIVEN:  # ``tier``: the value of the family's label, whichever it is
        values, label = FAMILIES[family].values, FAMILIES[family].label
        if tier not in values:
            raise ValueError(f"{name}: {label} must be one of {values}, got {tier!r}")
        return f"{name}@{tier}"
    if tier is not None:
        raise ValueError(f"{name} is counted for one tier only ({fixed}), not {tier!r}")
    return name


def series_of(key: str) -> tuple[str, dict[str, str]]:
    """(family, labels) of a payload key (``series_key``), or of an internal
    total (``SUMS``, ``tier_write_errors`` without a tier): then the labels
    are those all its series share, so summing the family's samples that
    carry them gives the total."""
    if key in SUMS:
        return SUMS[key], {}
    name, _, tier = key.partition("@")
    family, fixed = KEYS[name]
    if tier:
        return family, {FAMILIES[family].label: tier}
    return family, ({"tier": fixed} if fixed not in (None, GIVEN) else {})


# The names of 0.1.0 -> what replaced them (CHANGELOG.md lists them; a test
# checks it does).
RENAMED = {
    "kvbm_matched_tokens_total": "sum without (tier) (kvbm_matched_tokens_total)",
    "kvbm_matched_tokens_host_total": 'kvbm_matched_tokens_total{tier="host"}',
    "kvbm_matched_tokens_disk_total": 'kvbm_matched_tokens_total{tier="disk"}',
    "kvbm_matched_tokens_remote_total": 'kvbm_matched_tokens_total{tier="remote"}',
    "kvbm_offload_blocks_d2h_total": "kvbm_offload_blocks_total",
    "kvbm_onboard_blocks_h2d_total": "kvbm_onboard_blocks_total",
    "kvbm_offload_bytes_d2h_total": "kvbm_offload_bytes_total",
    "kvbm_onboard_bytes_h2d_total": "kvbm_onboard_bytes_total",
    "kvbm_host_evictions_total": 'kvbm_evicted_pages_total{tier="host"}',
    "kvbm_store_skipped_blocks_total": "kvbm_offload_skipped_blocks_total",
    "kvbm_store_errors_total": "kvbm_offload_failed_transfers_total",
    "kvbm_load_error_blocks_total": "kvbm_onboard_failed_blocks_total",
    "kvbm_onboard_blocks_d2d_total": 'kvbm_tier_read_blocks_total{tier="disk"}',
    "kvbm_onboard_blocks_remote_total": 'kvbm_tier_read_blocks_total{tier="remote"}',
    "kvbm_offload_blocks_h2d_total": 'kvbm_tier_write_blocks_total{tier="disk"}',
    "kvbm_offload_blocks_remote_total": 'kvbm_tier_write_blocks_total{tier="remote"}',
    "kvbm_tier_write_errors_total": "kvbm_tier_write_failed_pages_total{tier}",
    "kvbm_tier_write_drops_total": "kvbm_tier_write_dropped_pages_total{tier}",
    "kvbm_tier_read_misses_total": "kvbm_tier_read_missing_pages_total{tier}",
    "kvbm_tier_read_errors_total": "kvbm_tier_read_failed_pages_total{tier}",
    "kvbm_checksum_failures_total": "kvbm_checksum_failed_pages_total{tier}",
    "kvbm_page_auth_failures_total": "kvbm_unauthenticated_pages_total{tier}",
    "kvbm_host_cache_used_blocks": 'kvbm_cache_used_blocks{tier="host"}',
    "kvbm_host_cache_capacity_blocks": 'kvbm_cache_capacity_blocks{tier="host"}',
    "kvbm_host_cache_used_bytes": 'kvbm_cache_used_bytes{tier="host"}',
    "kvbm_host_cache_capacity_bytes": 'kvbm_cache_capacity_bytes{tier="host"}',
    "kvbm_host_cache_hit_rate": 'kvbm_recent_hit_ratio{tier="host"}',
    "kvbm_disk_cache_hit_rate": 'kvbm_recent_hit_ratio{tier="disk"}',
    "kvbm_remote_cache_hit_rate": 'kvbm_recent_hit_ratio{tier="remote"}',
    "kvbm_load_seconds_per_block_host": 'kvbm_block_load_estimate_seconds{tier="host"}',
    "kvbm_load_seconds_per_block_disk": 'kvbm_block_load_estimate_seconds{tier="disk"}',
    "kvbm_load_seconds_per_block_remote": 'kvbm_block_load_estimate_seconds{tier="remote"}',
    "kvbm_recompute_seconds_per_block": "kvbm_block_recompute_estimate_seconds",
}

# Renamed since 0.2.0 -> their names now (CHANGELOG.md's [Unreleased] lists
# them; a test checks it does): one unit per group of related series.
RENAMED_SINCE_0_2 = {
    "kvbm_tier_read_blocks_total": "kvbm_tier_read_pages_total",
    "kvbm_tier_write_blocks_total": "kvbm_tier_write_pages_total",
    "kvbm_evicted_pages_total": "kvbm_evicted_blocks_total",
}
