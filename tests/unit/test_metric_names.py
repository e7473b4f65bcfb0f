"""The exported metrics follow Prometheus's conventions: the unit as the
suffix, the tier as a label, build info; read back from a real exposition
(the standalone port's HTTP endpoint, and vLLM's metric classes)."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import vllm_kvbm
from helpers import ROOT
from vllm_kvbm.metric_names import (
    COUNTERS,
    FAMILIES,
    GAUGES,
    GIVEN,
    HISTOGRAMS,
    RENAMED,
    RENAMED_SINCE_0_2,
    SUMS,
    series_key,
    series_of,
)
from vllm_kvbm.metrics import KVBMPromMetrics, KVBMStats, StandaloneMetrics
from vllm_kvbm.tools.server import free_port

UNITS = {
    "counter": (
        "_tokens",
        "_blocks",
        "_bytes",
        "_pages",
        "_transfers",
        "_timeouts",
        "_reconnects",
        "_requests",
        "_lookups",
        "_entries",
    ),
    "histogram": ("_seconds",),
    "gauge": ("_blocks", "_bytes", "_seconds", "_ratio", "_info", "_up", "_slots"),
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("family", FAMILIES.values(), ids=lambda f: f.name)
def test_names_end_in_their_unit_and_name_no_tier(family):
    assert family.name.startswith("kvbm_")
    assert family.name.endswith(UNITS[family.kind]), family.name
    assert not family.name.endswith("_total")  # the client appends it to counters
    # one quantity of several tiers is one family with a tier label
    words = family.name.split("_")
    assert not {"host", "disk", "remote", "d2h", "h2d", "d2d"} & set(words), family.name
    assert family.doc


def test_every_key_feeds_a_family_and_every_family_is_fed():
    fed = {"kvbm_build_info"}  # set by the exporter itself
    for table, kind in ((COUNTERS, "counter"), (HISTOGRAMS, "histogram"), (GAUGES, "gauge")):
        for name, (family, tier) in table.items():
            assert FAMILIES[family].kind == kind, name
            assert tier is None or tier == GIVEN or tier in FAMILIES[family].values, name
            assert (tier is None) == (not FAMILIES[family].values), name
            fed.add(family)
    assert fed == set(FAMILIES)
    assert series_of("matched_tokens") == ("kvbm_matched_tokens", {})
    assert series_of("matched_tokens_disk") == ("kvbm_matched_tokens", {"tier": "disk"})
    assert series_of("tier_write_errors@remote") == (
        "kvbm_tier_write_failed_pages",
        {"tier": "remote"},
    )
    assert all(FAMILIES[family].tiers for family in SUMS.values())
    assert series_of("transfer_timeouts@no_staging_slot") == (
        "kvbm_transfer_timeouts",
        {"event": "no_staging_slot"},
    )
    assert series_of("refused_params@hint") == ("kvbm_refused_param_requests", {"param": "hint"})


def test_a_tier_is_named_where_the_family_has_several():
    assert series_key("tier_read_errors", "disk") == "tier_read_errors@disk"
    with pytest.raises(ValueError, match="tier must be one of"):
        series_key("tier_read_errors")
    with pytest.raises(ValueError, match="tier must be one of"):
        series_key("tier_read_errors", "host")  # the host tier is never read from
    with pytest.raises(ValueError, match="one tier only"):
        series_key("offload_blocks_h2d", "remote")
    assert series_key("transfer_timeouts", "overdue") == "transfer_timeouts@overdue"
    with pytest.raises(ValueError, match="event must be one of"):
        series_key("transfer_timeouts", "disk")


def test_related_series_count_one_unit():
    """A tier's writes, reads and failures count pages; what moves to and from
    the engine's KV cache, and the host tier's capacity and evictions, count
    blocks; kvbm_page_size_blocks converts."""
    tier_io = [
        f
        for f in FAMILIES
        if f.startswith(("kvbm_tier_write_", "kvbm_tier_read_")) and FAMILIES[f].kind == "counter"
    ]
    assert len(tier_io) == 6 and all(f.endswith("_pages") for f in tier_io), tier_io
    host = [
        f
        for f in FAMILIES
        if "host" in FAMILIES[f].tiers
        and FAMILIES[f].kind != "histogram"
        and not f.endswith(("_bytes", "_tokens", "_ratio", "_seconds"))
    ]
    assert sorted(host) == [
        "kvbm_cache_capacity_blocks",
        "kvbm_cache_used_blocks",
        "kvbm_evicted_blocks",
    ]
    assert FAMILIES["kvbm_page_size_blocks"].kind == "gauge"


def test_standalone_port_serves_tiers_as_labels_and_build_info():
    port = free_port()
    sink = StandaloneMetrics(port, "127.0.0.1")
    try:
        stats = KVBMStats(sink)
        stats.declare(["host", "disk"])
        stats.add("lookup_tokens", 256)
        stats.add("matched_tokens", 192)
        stats.add("matched_tokens_host", 128)
        stats.add("matched_tokens_disk", 64)
        stats.add("offload_blocks_h2d", 3)
        stats.add("tier_write_errors", 2, tier="disk")
        stats.observe("tier_read_latency_seconds", [0.02], "disk")
        stats.observe("load_latency_seconds", [0.05, 0.5])
        stats.set_gauge("disk_cache_used_bytes", 4096)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        sink.close()
    got = samples(text)
    tier = lambda t: (("tier", t),)  # noqa: E731
    assert got[("kvbm_lookup_tokens_total", ())] == 256
    assert got[("kvbm_matched_tokens_total", tier("host"))] == 128
    assert got[("kvbm_matched_tokens_total", tier("disk"))] == 64
    assert got[("kvbm_tier_write_pages_total", tier("disk"))] == 3
    assert got[("kvbm_tier_write_failed_pages_total", tier("disk"))] == 2
    assert got[("kvbm_tier_read_latency_seconds_count", tier("disk"))] == 1
    assert got[("kvbm_load_latency_seconds_count", ())] == 2
    assert got[("kvbm_cache_used_bytes", tier("disk"))] == 4096
    assert got[("kvbm_recent_hit_ratio", tier("disk"))] == 64 / 256
    assert got[("kvbm_build_info", (("version", vllm_kvbm.__version__),))] == 1
    # declared at 0: a configured tier's series exist before their first count
    assert got[("kvbm_tier_read_pages_total", tier("disk"))] == 0
    # labels other than the tier: every value, whatever the engine's tiers
    for event in ("not_started", "overdue", "no_staging_slot"):
        assert got[("kvbm_transfer_timeouts_total", (("event", event),))] == 0
    assert got[("kvbm_refused_param_requests_total", (("param", "store"),))] == 0
    assert got[("kvbm_lookup_latency_seconds_count", tier("disk"))] == 0
    # and no series of a tier this engine does not have, nor old names
    assert not [key for key in got if ("tier", "remote") in key[1]]
    assert not [key for key in got if re.search(r"_(d2h|h2d|d2d)|hit_rate", key[0])]
    # the matched-token total is the sum of the family, not a series of its own
    assert sum(v for (name, _), v in got.items() if name == "kvbm_matched_tokens_total") == 192


def test_vllm_serve_exposition_has_engine_labels_and_tiers():
    """Through the metric classes vLLM hands the connector (here on a private
    registry), one series per engine and tier."""
    registry = CollectorRegistry()

    def on(cls):
        return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)

    class VllmConfig:
        kv_transfer_config = None

    prom = KVBMPromMetrics(
        VllmConfig(),
        {Counter: on(Counter), Gauge: on(Gauge), Histogram: on(Histogram)},
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    for engine, stats_tiers in ((0, ["host", "remote"]), (1, ["host"])):
        stats = KVBMStats()
        stats.declare(stats_tiers)
        stats.add("offload_blocks_d2h", 4 + engine)
        if "remote" in stats_tiers:
            stats.add("checksum_failures", 1, tier="remote")
            stats.set_gauge("tier_up", 1.0, "remote")
        prom.observe(stats.take(), engine)
    got = samples(generate_latest(registry).decode())

    def labels(engine, **more):
        return tuple(sorted({"model_name": "m", "engine": str(engine), **more}.items()))

    assert got[("kvbm_offload_blocks_total", labels(0))] == 4
    assert got[("kvbm_offload_blocks_total", labels(1))] == 5
    assert got[("kvbm_checksum_failed_pages_total", labels(0, tier="remote"))] == 1
    assert got[("kvbm_tier_up", labels(0, tier="remote"))] == 1
    assert ("kvbm_tier_up", labels(1, tier="remote")) not in got
    assert got[("kvbm_build_info", labels(1, version=vllm_kvbm.__version__))] == 1


def test_remote_link_up_and_reconnects_from_a_real_server():
    """The remote tier's up gauge and reconnect counter, as the scheduler's
    lookup link to a real LMCache server sees it go from absent to answering;
    each lookup call attempted is timed."""
    from helpers.lm_server import LMServer
    from vllm_kvbm.scheduler.tier_policy import LowerTiers
    from vllm_kvbm.tiers.lm.view import RemoteView

    server = LMServer()  # its port, nothing listening yet
    view = RemoteView(server.url, "ns", 4096, 1, timeout_s=1.0, retry_interval_s=0.05)
    lower, stats = LowerTiers([view]), KVBMStats()
    try:
        assert lower.find_run([b"k" * 32]) == []  # refused: down
        lower.report_links(stats)
        assert stats.gauges["tier_up@remote"] == 0.0
        assert stats.total["tier_reconnects"] == 0
        server.start()
        server.wait_ready()
        deadline = time.monotonic() + 30
        while view.down:  # the next attempt after the backoff
            assert time.monotonic() < deadline, "the view never reconnected"
            lower.find_run([b"k" * 32])
            time.sleep(0.05)
        lower.report_links(stats)
        assert stats.gauges["tier_up@remote"] == 1.0
        assert stats.total["tier_reconnects"] == 1
        timed = stats.take()["histograms"]["lookup_latency_seconds@remote"]
        assert len(timed) >= 2  # the refused call and the answered one, not the skipped ones
        lower.report_links(stats)
        assert stats.total["tier_reconnects"] == 1  # counted once
    finally:
        view.close()
        server.kill()


def test_changelog_lists_every_old_name_with_its_replacement():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    # the names changed in 0.2.0
    section = changelog.split("## [0.2.0]", 1)[1].split("\n## ", 1)[0]
    for old, new in RENAMED.items():
        line = next((ln for ln in section.splitlines() if f"`{old}`" in ln), None)
        assert line is not None, f"{old} is not in the 0.2.0 section of CHANGELOG.md"
        assert f"`{new}`" in line, (old, new, line)


def test_changelog_lists_the_names_changed_since_0_2():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    section = changelog.split("## [Unreleased]", 1)[1].split("\n## ", 1)[0]
    for old, new in RENAMED_SINCE_0_2.items():
        line = next((ln for ln in section.splitlines() if f"`{old}`" in ln), None)
        assert line is not None, f"{old} is not in the [Unreleased] section of CHANGELOG.md"
        assert f"`{new}`" in line, (old, new, line)
