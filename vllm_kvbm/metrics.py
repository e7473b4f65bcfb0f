"""Counters of what the connector did, and their Prometheus export.

The scheduler side accumulates counter deltas (its own lookups, and the
worker side's transfers reported through the worker metadata); vLLM collects
them through ``get_kv_connector_stats`` each logging interval and hands them
to ``KVBMPromMetrics.observe`` in the API server process, so they appear on
``vllm serve``'s ``/metrics`` with vLLM's own engine labels.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# counter name -> help text. Names follow Dynamo's KVBM where the meaning matches.
COUNTERS = {
    "matched_tokens": "Prompt tokens found in KVBM tiers beyond the engine's own prefix cache",
    "lookup_tokens": "Prompt tokens looked up in KVBM (beyond the engine's prefix cache)",
    "offload_blocks_d2h": "Blocks offloaded from the engine's KV cache to the host tier",
    "onboard_blocks_h2d": "Blocks onboarded from the host tier into the engine's KV cache",
    "offload_bytes_d2h": "Bytes offloaded from the engine's KV cache to the host tier",
    "onboard_bytes_h2d": "Bytes onboarded from the host tier into the engine's KV cache",
    "host_evictions": "Host-tier pages (slots) evicted (least recently used) to make room",
    "store_skipped_blocks": "Blocks not offloaded because every host slot was in use by transfers",
    "store_errors": "Offload transfers that failed (their blocks were not cached)",
    "load_error_blocks": "Blocks whose onboarding failed and were recomputed by vLLM",
    "matched_tokens_host": "Matched tokens found in the host tier",
    "matched_tokens_disk": "Matched tokens found in the disk tier",
    "matched_tokens_remote": "Matched tokens found in the remote tier",
    "onboard_blocks_d2d": "Blocks onboarded from the disk tier (via the host tier) into the engine",
    "onboard_blocks_remote": "Blocks onboarded from the remote tier (via the host tier) into the engine",
    "offload_blocks_h2d": "Blocks written from the host tier to the disk tier",
    "offload_blocks_remote": "Blocks written from the host tier to the remote tier",
    "tier_write_errors": "Pages a lower tier (disk or remote) refused or failed to write",
    "tier_write_drops": "Pages not written to a lower tier (disk or remote) because its write "
                        "queue was full (the tier is slower than the offload rate); written "
                        "when next reused",
    "tier_read_misses": "Pages expected in a lower tier that were gone when read",
    "tier_read_errors": "Lower-tier reads that failed (I/O error, timeout, server down)",
    "checksum_failures": "Pages whose bytes or key did not match their checksum; removed, recomputed",
    "page_auth_failures": "Intact pages without a valid MAC for this deployment's page secret "
                          "(written without it, with another secret, or forged); removed, "
                          "recomputed",
    "recompute_chosen_tokens": "Prompt tokens found in a tier but recomputed on purpose: loading "
                               "them was expected to take longer (learned costs, load_split)",
    "transfer_timeouts": "NIXL transfers still running after 30 s (stores are dropped, their "
                         "host slots held until the copy ends), and streamed loads that got "
                         "no staging slot within tier_read_timeout_s (recomputed)",
}


# histogram name -> (help text, buckets)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0)
HISTOGRAMS = {
    "offload_latency_seconds": ("Time from posting an offload (device->host) transfer "
                                "to its completion, per transfer", _LATENCY_BUCKETS),
    "onboard_latency_seconds": ("Time from posting an onboard (host->device) transfer "
                                "to its completion, per transfer", _LATENCY_BUCKETS),
}

# Admitted requests the *_cache_hit_rate gauges cover, as Dynamo's KVBM (its
# DYN_KVBM_CACHE_STATS_MAX_REQUESTS default): the most recent ones, so the rate
# follows the workload instead of averaging over the server's whole life.
HIT_RATE_WINDOW = 1000
_HIT_TIERS = ("host", "disk", "remote")


def _hit_rate_help(tier: str) -> str:
    return (f"{tier.capitalize()} cache hit rate (0.0-1.0), Dynamo KVBM's name: prompt tokens "
            f"found in the {tier} tier / prompt tokens looked up in KVBM (beyond the engine's "
            f"own prefix cache), summed over the last {HIT_RATE_WINDOW} admitted requests")


# gauge name -> help text
GAUGES = {
    "host_cache_used_blocks": "Host-tier blocks holding or receiving KV",
    "host_cache_capacity_blocks": "Host-tier capacity in blocks",
    "host_cache_used_bytes": "Host-tier bytes holding or receiving KV (per worker)",
    "host_cache_capacity_bytes": "Host-tier capacity in bytes (per worker)",
    **{f"{tier}_cache_hit_rate": _hit_rate_help(tier) for tier in _HIT_TIERS},
    **{f"load_seconds_per_block_{tier}": f"Learned time to load one block from the {tier} "
       f"tier into the engine (admission to completion); 0 until learned"
       for tier in _HIT_TIERS},
    "recompute_seconds_per_block": "Learned time to recompute one block at the start of a "
                                   "prompt (later blocks cost more: attention); 0 until learned",
}


class KVBMStats:
    """Scheduler-side accumulator; ``take`` returns and clears the deltas.

    With a ``sink`` (the standalone exporter) every update is also applied to
    it directly, independent of vLLM's stat logging.
    """

    def __init__(self, sink: "StandaloneMetrics | None" = None) -> None:
        self.sink = sink
        self.delta: Counter = Counter()
        self.total: Counter = Counter()
        self.samples: dict[str, list[float]] = {}
        self.gauges: dict[str, float] = {}
        self._sent_gauges: dict[str, float] = {}
        # per admitted request: [lookup tokens, host, disk, remote matched tokens]
        self._window: deque[list[int]] = deque()
        self._window_sums = [0] * (1 + len(_HIT_TIERS))

    def add(self, name: str, value: int = 1) -> None:
        assert name in COUNTERS, name
        if value:
            self.delta[name] += value
            self.total[name] += value
            if self.sink is not None:
                self.sink.counters[name].inc(value)
            self._track_hit_rates(name, value)

    def _track_hit_rates(self, name: str, value: int) -> None:
        """The *_cache_hit_rate gauges, from the counters the planner adds when
        it admits a request: ``lookup_tokens`` starts the request's entry, its
        ``matched_tokens_<tier>`` follow."""
        if name == "lookup_tokens":
            entry = [value] + [0] * len(_HIT_TIERS)
            self._window.append(entry)
            if len(self._window) > HIT_RATE_WINDOW:
                old = self._window.popleft()
                self._window_sums = [a - b for a, b in zip(self._window_sums, old)]
            self._window_sums[0] += value
        elif name.startswith("matched_tokens_") and self._window:
            i = 1 + _HIT_TIERS.index(name.removeprefix("matched_tokens_"))
            self._window[-1][i] += value
            self._window_sums[i] += value
        else:
            return
        looked_up = self._window_sums[0]
        for i, tier in enumerate(_HIT_TIERS, 1):
            self.set_gauge(f"{tier}_cache_hit_rate",
                           self._window_sums[i] / looked_up if looked_up else 0.0)

    def observe(self, name: str, values: list[float]) -> None:
        assert name in HISTOGRAMS, name
        if values:
            self.samples.setdefault(name, []).extend(values)
            if self.sink is not None:
                for value in values:
                    self.sink.histograms[name].observe(value)

    def set_gauge(self, name: str, value: float) -> None:
        assert name in GAUGES, name
        self.gauges[name] = value
        if self.sink is not None:
            self.sink.gauges[name].set(value)

    def take(self) -> dict[str, Any]:
        """The payload of one ``KVBMConnectorStats``; empty when nothing changed."""
        data: dict[str, Any] = {}
        if self.delta:
            data["counters"], self.delta = dict(self.delta), Counter()
        if self.samples:
            data["histograms"], self.samples = self.samples, {}
        if self.gauges != self._sent_gauges:
            data["gauges"] = dict(self.gauges)
            self._sent_gauges = dict(self.gauges)
        return data


@dataclass
class KVBMConnectorStats(KVConnectorStats):
    """``data`` is ``{"counters": {..}, "histograms": {..: [..]}, "gauges": {..}}``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBMConnectorStats":
        for name, value in other.data.get("counters", {}).items():
            counters = self.data.setdefault("counters", {})
            counters[name] = counters.get(name, 0) + value
        for name, values in other.data.get("histograms", {}).items():
            self.data.setdefault("histograms", {}).setdefault(name, []).extend(values)
        if "gauges" in other.data:
            self.data.setdefault("gauges", {}).update(other.data["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data.get("counters", {}))
        out.update(self.data.get("gauges", {}))
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "histograms", "gauges"))


def _unregister_previous() -> None:
    """A second engine in one process (offline LLM use) re-creates the
    metrics; vLLM unregisters only its own vllm: names, so do it for ours."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        names = REGISTRY._collector_to_names.get(collector, ())
        if any(name.startswith("kvbm_") for name in names):
            REGISTRY.unregister(collector)


class KVBMPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()

        def per_engine(metric):
            return {idx: metric.labels(*values)
                    for idx, values in per_engine_labelvalues.items()}

        self._counters = {
            name: per_engine(self._counter_cls(name=f"kvbm_{name}", documentation=doc,
                                               labelnames=labelnames))
            for name, doc in COUNTERS.items()}
        self._histograms = {
            name: per_engine(self._histogram_cls(name=f"kvbm_{name}", documentation=doc,
                                                 labelnames=labelnames, buckets=buckets))
            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._gauges = {
            name: per_engine(self._gauge_cls(name=f"kvbm_{name}", documentation=doc,
                                             labelnames=labelnames,
                                             multiprocess_mode="mostrecent"))
            for name, doc in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
        for name, values in transfer_stats_data.get("histograms", {}).items():
            if name in self._histograms:
                for value in values:
                    self._histograms[name][engine_idx].observe(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(value)


class StandaloneMetrics:
    """The kvbm_* metrics on their own port, in a private registry.

    For offline ``vllm.LLM`` use (and engines started without stat logging):
    the scheduler process serves them at http://HOST:PORT/metrics.
    """

    def __init__(self, port: int, host: str = "0.0.0.0"):
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                                       start_http_server)

        self.registry = CollectorRegistry()
        self.counters = {name: Counter(f"kvbm_{name}", doc, registry=self.registry)
                         for name, doc in COUNTERS.items()}
        self.histograms = {name: Histogram(f"kvbm_{name}", doc, buckets=buckets,
                                           registry=self.registry)
                           for name, (doc, buckets) in HISTOGRAMS.items()}
        self.gauges = {name: Gauge(f"kvbm_{name}", doc, registry=self.registry)
                       for name, doc in GAUGES.items()}
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        self.server.shutdown()
