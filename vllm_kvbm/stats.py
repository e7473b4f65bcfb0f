"""Counters of what the connector did, and their Prometheus export.

The scheduler side accumulates counter deltas (its own lookups, and the
worker side's transfers reported through the worker metadata); vLLM collects
them through ``get_kv_connector_stats`` each logging interval and hands them
to ``KVBMPromMetrics.observe`` in the API server process, so they appear on
``vllm serve``'s ``/metrics`` with vLLM's own engine labels.
"""

from __future__ import annotations

from collections import Counter
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
    "host_evictions": "Host-tier blocks evicted (least recently used) to make room",
    "store_skipped_blocks": "Blocks not offloaded because every host slot was in use by transfers",
    "store_errors": "Offload transfers that failed (their blocks were not cached)",
    "load_error_blocks": "Blocks whose onboarding failed and were recomputed by vLLM",
}


class KVBMStats:
    """Scheduler-side accumulator; ``take`` returns and clears the deltas."""

    def __init__(self) -> None:
        self.delta: Counter = Counter()
        self.total: Counter = Counter()

    def add(self, name: str, value: int = 1) -> None:
        assert name in COUNTERS, name
        if value:
            self.delta[name] += value
            self.total[name] += value

    def take(self) -> dict[str, int]:
        delta, self.delta = dict(self.delta), Counter()
        return delta


@dataclass
class KVBMConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBMConnectorStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


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
        self._counters = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"kvbm_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {idx: metric.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
