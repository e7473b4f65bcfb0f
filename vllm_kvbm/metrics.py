"""Counters of what the connector did, and their Prometheus export.

The scheduler side accumulates counter deltas (its own lookups, and the
worker side's transfers reported through the worker metadata); vLLM collects
them through ``get_kv_connector_stats`` each logging interval and hands them
to ``KVBMPromMetrics.observe`` in the API server process, so they appear on
``vllm serve``'s ``/metrics`` with vLLM's own engine labels. The names, types
and labels are in metric_names.py.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvbm.metric_names import (
    COUNTERS,
    FAMILIES,
    GAUGES,
    GIVEN,
    HISTOGRAMS,
    HIT_RATE_WINDOW,
    KEYS,
    SUMS,
    TIERS,
    series_key,
    series_of,
)

__all__ = [
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "HIT_RATE_WINDOW",
    "KVBMConnectorStats",
    "KVBMPromMetrics",
    "KVBMStats",
    "StandaloneMetrics",
    "declared_keys",
]

_HIT_TIERS = TIERS


def declared_keys(tiers: "list[str] | tuple[str, ...]") -> list[str]:
    """The payload keys of every counter and histogram series an engine with
    these tiers has: exported at 0 from the start, so a rate sees the first
    increment and a dashboard shows each configured tier (and no other)."""
    keys = []
    for table in (COUNTERS, HISTOGRAMS):
        for name, (family, fixed) in table.items():
            if fixed is None:
                keys.append(name)
            elif fixed == GIVEN:  # a tier label: the engine's tiers; another: all its values
                f = FAMILIES[family]
                keys += [series_key(name, v) for v in f.values if f.label != "tier" or v in tiers]
            elif fixed in tiers:
                keys.append(name)
    return keys


class KVBMStats:
    """Scheduler-side accumulator; ``take`` returns and clears the deltas.

    ``total`` keeps each internal key's running sum over its tiers (what the
    scheduler's tests and logs read); the payload is per series
    (``metric_names.series_key``). With a ``sink`` (the standalone exporter)
    every update is also applied to it directly, independent of vLLM's stat
    logging.
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
        self.tiers: tuple[str, ...] = _HIT_TIERS  # the engine's (declare)

    def declare(self, tiers: "list[str] | tuple[str, ...]") -> None:
        """Exports every series of an engine with these tiers, at 0 until
        counted; the per-tier gauges only of these tiers from now on."""
        self.tiers = tuple(t for t in _HIT_TIERS if t in tiers)
        for tier in self.tiers:
            self.set_gauge(f"{tier}_cache_hit_rate", 0.0)
        for key in declared_keys(tiers):
            name = key.partition("@")[0]
            if name in COUNTERS:
                self.delta[key] += 0
            else:
                self.samples.setdefault(key, [])
            if self.sink is not None:
                self.sink.child(key)

    def add(self, name: str, value: int = 1, tier: str | None = None) -> None:
        if name in SUMS:  # internal only: the sum of its family's series
            self.total[name] += value
            return
        assert name in COUNTERS, name
        key = series_key(name, tier)
        if value:
            self.delta[key] += value
            self.total[name] += value
            if self.sink is not None:
                self.sink.child(key).inc(value)
            self._track_hit_rates(name, value)

    def _track_hit_rates(self, name: str, value: int) -> None:
        """The recent hit ratio gauges, from the counters the planner adds when
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
            if tier in self.tiers:
                self.set_gauge(
                    f"{tier}_cache_hit_rate", self._window_sums[i] / looked_up if looked_up else 0.0
                )

    def observe(self, name: str, values: list[float], tier: str | None = None) -> None:
        assert name in HISTOGRAMS, name
        if values:
            key = series_key(name, tier)
            self.samples.setdefault(key, []).extend(values)
            if self.sink is not None:
                for value in values:
                    self.sink.child(key).observe(value)

    def set_gauge(self, name: str, value: float, tier: str | None = None) -> None:
        assert name in GAUGES, name
        key = series_key(name, tier)
        self.gauges[key] = value
        if self.sink is not None:
            self.sink.child(key).set(value)

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
    """``data`` is ``{"counters": {..}, "histograms": {..: [..]}, "gauges": {..}}``,
    keyed by ``metric_names.series_key``."""

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


def _version() -> str:
    from vllm_kvbm import __version__

    return __version__


class _Families:
    """The kvbm_* families and their series, for one set of base labels.

    ``make(family, labelnames)`` creates one metric (metric_names.Family);
    ``base``: the values of the labels every series has (vLLM's model_name and
    engine; none on the standalone port). Series without a tier label exist
    from the start (0); tiered ones once declared or counted."""

    def __init__(self, make, labelnames: list[str], base_values: list[list[str]]):
        self._base = base_values
        self._metrics = {}
        for family in FAMILIES.values():
            if family.name == "kvbm_build_info":
                continue
            names = labelnames + ([family.label] if family.values else [])
            self._metrics[family.name] = make(family, names)
        self._children: list[dict[str, Any]] = [{} for _ in base_values]
        for name, (family, fixed) in KEYS.items():
            if fixed is None and FAMILIES[family].kind != "gauge":
                for i in range(len(base_values)):
                    self.child(name, i)
        info = make(FAMILIES["kvbm_build_info"], labelnames + ["version"])
        for values in base_values:
            info.labels(*values, _version()).set(1)

    def child(self, key: str, i: int = 0):
        children = self._children[i]
        child = children.get(key)
        if child is None:
            family, labels = series_of(key)
            values = self._base[i] + list(labels.values())
            metric = self._metrics[family]
            child = children[key] = metric.labels(*values) if values else metric
        return child

    def observe(self, data: dict[str, Any], i: int = 0) -> None:
        for key, value in data.get("counters", {}).items():
            if key.partition("@")[0] in COUNTERS:
                child = self.child(key, i)  # created at 0 even when value is 0
                if value:
                    child.inc(value)
        for key, values in data.get("histograms", {}).items():
            if key.partition("@")[0] in HISTOGRAMS:
                child = self.child(key, i)
                for value in values:
                    child.observe(value)
        for key, value in data.get("gauges", {}).items():
            if key.partition("@")[0] in GAUGES:
                self.child(key, i).set(value)


class KVBMPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()

        def make(family, names):
            if family.kind == "counter":
                return self._counter_cls(
                    name=family.name, documentation=family.doc, labelnames=names
                )
            if family.kind == "histogram":
                return self._histogram_cls(
                    name=family.name,
                    documentation=family.doc,
                    labelnames=names,
                    buckets=family.buckets,
                )
            return self._gauge_cls(
                name=family.name,
                documentation=family.doc,
                labelnames=names,
                multiprocess_mode="mostrecent",
            )

        self._engines = list(per_engine_labelvalues)
        self._families = _Families(
            make, list(labelnames), [list(per_engine_labelvalues[idx]) for idx in self._engines]
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._families.observe(transfer_stats_data, self._engines.index(engine_idx))


class StandaloneMetrics:
    """The kvbm_* metrics on their own port, in a private registry.

    For offline ``vllm.LLM`` use (and engines started without stat logging):
    the scheduler process serves them at http://HOST:PORT/metrics.
    """

    def __init__(self, port: int, host: str = "0.0.0.0"):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        self.registry = CollectorRegistry()

        def make(family, names):
            cls = {"counter": Counter, "histogram": Histogram, "gauge": Gauge}[family.kind]
            extra = {"buckets": family.buckets} if family.kind == "histogram" else {}
            return cls(family.name, family.doc, names, registry=self.registry, **extra)

        self._families = _Families(make, [], [[]])
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def child(self, key: str):
        """The series of a payload key (``metric_names.series_key``)."""
        return self._families.child(key)

    def close(self) -> None:
        self.server.shutdown()
