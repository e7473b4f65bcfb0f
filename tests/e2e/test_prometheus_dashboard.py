"""The Grafana dashboard against a real Prometheus scraping a real `vllm serve`.

One `vllm serve` with KVBMConnector (host tier, disk tier and a real LMCache
server as the remote tier) and an engine KV cache too small for two
documents runs document A (miss), B (miss, pushes A out of the engine's prefix
cache) and A again (host-tier hit); a Prometheus started here scrapes it every
second. The counters Prometheus holds must be what that workload must have
caused. Then, with vLLM's and KVBM's memory caches reset, B again comes from
the disk tier, and every PromQL expression of grafana/dashboards/kvbm.json
must return data through Prometheus's query API. The same Prometheus loads KVBM's
alert rules (deploy/prometheus/kvbm-alerts.yml): every rule evaluates without an
error on the real series, and none fires on this healthy workload.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

import vllm_kvbm
from helpers import ROOT
from helpers.engines import MODEL_DIR
from helpers.prometheus import ALERT_RULES, Prometheus
from vllm_kvbm.metric_names import FAMILIES
from vllm_kvbm.tools.server import (
    Server,
    free_port,
    kvbm_transfer_config,
    start_lmcache_server,
    stop_process,
    vllm_server,
)

pytestmark = pytest.mark.timeout(600)

DASHBOARD = ROOT / "grafana" / "dashboards" / "kvbm.json"
BLOCK = 128
ENGINE_BLOCKS = 28
HOST_CACHE = "1GiB"
DISK_CACHE = "512MiB"
SERVE_ARGS = [
    "--enforce-eager",
    "--block-size",
    str(BLOCK),
    "--num-gpu-blocks-override",
    str(ENGINE_BLOCKS),
    "--max-model-len",
    "3456",
    "--max-num-batched-tokens",
    "3456",
    "--gpu-memory-utilization",
    "0.3",
]
# What Grafana would put in for the dashboard's variables: "All" models and
# instances, and a rate window that covers the whole workload.
VARIABLES = {"$__rate_interval": "5m", "$model_name": ".*", "$instance": ".*"}


def series(family: str, tier: str | None = None) -> str:
    """A series' sample as a scrape shows it (counters with _total, histograms' _count)."""
    sample = FAMILIES[family].sample if family in FAMILIES else family
    return f'{sample}{{tier="{tier}"}}' if tier else sample


# Zero in this workload: nothing evicted, skipped or failed; nothing read
# from a lower tier (A's hit is in the host tier), no outage.
ZERO = (
    [
        series(f)
        for f in (
            "kvbm_offload_skipped_blocks",
            "kvbm_offload_failed_transfers",
            "kvbm_onboard_failed_blocks",
            "kvbm_transfer_timeouts",
            "kvbm_refused_param_requests",
            "kvbm_peer_directory_lookups",
            "kvbm_peer_directory_entries",
            "kvbm_peer_quarantined_slots",
        )
    ]
    + [series("kvbm_evicted_blocks", "host"), series("kvbm_tier_reconnects", "remote")]
    + [
        series(f, tier)
        for tier in ("disk", "remote")
        for f in (
            "kvbm_matched_tokens",
            "kvbm_tier_read_pages",
            "kvbm_tier_write_failed_pages",
            "kvbm_tier_write_dropped_pages",
            "kvbm_tier_read_missing_pages",
            "kvbm_tier_read_failed_pages",
            "kvbm_checksum_failed_pages",
            "kvbm_unauthenticated_pages",
        )
    ]
)
# Every value the checks read: from Prometheus, and from /metrics to compare.
METRICS = ZERO + [
    series("kvbm_lookup_tokens"),
    series("kvbm_matched_tokens", "host"),
    series("kvbm_offload_blocks"),
    series("kvbm_onboard_blocks"),
    series("kvbm_offload_bytes"),
    series("kvbm_onboard_bytes"),
    series("kvbm_offload_latency_seconds"),
    series("kvbm_onboard_latency_seconds"),
    series("kvbm_load_latency_seconds"),
    series("kvbm_cache_used_blocks", "host"),
    series("kvbm_cache_capacity_blocks", "host"),
    series("kvbm_cache_used_bytes", "host"),
    series("kvbm_cache_capacity_bytes", "host"),
    series("kvbm_cache_used_bytes", "disk"),
    series("kvbm_cache_capacity_bytes", "disk"),
    *[series("kvbm_recent_hit_ratio", tier) for tier in ("host", "disk", "remote")],
    *[
        series(f, tier)
        for tier in ("disk", "remote")
        for f in (
            "kvbm_tier_write_pages",
            "kvbm_lookup_latency_seconds",
            "kvbm_tier_write_latency_seconds",
        )
    ],
    series("kvbm_tier_up", "remote"),
    series("kvbm_page_size_blocks"),
    f'kvbm_build_info{{version="{vllm_kvbm.__version__}"}}',
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
]


def dashboard_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    found = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def metrics_values(server) -> dict[str, float]:
    text = server.metrics()
    values = {}
    for name in METRICS:
        sample, _, labels = name.partition("{")
        wanted = dict(pair.split("=") for pair in labels.rstrip("}").split(",")) if labels else {}
        values[name] = Server.metric_total(
            text, sample, **{k: v.strip('"') for k, v in wanted.items()}
        )
    return values


def wait_settled(server, timeout: float = 60) -> dict[str, float]:
    """/metrics once the workload's last transfers are counted and nothing moves."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        values = metrics_values(server)
        if values["kvbm_onboard_blocks_total"] > 0 and values == previous:
            return values
        if time.monotonic() > deadline:
            raise TimeoutError(f"/metrics did not settle after {timeout:.0f} s: {values}")
        previous = values
        time.sleep(2)


def reset_memory_caches(server) -> None:
    """vLLM's prefix cache and KVBM's host tier (the disk and remote tiers stay)."""
    reset = urllib.request.Request(
        f"{server.url}/reset_prefix_cache?reset_external=true", method="POST"
    )
    with urllib.request.urlopen(reset, timeout=60) as resp:
        assert resp.status == 200


@pytest.fixture(scope="module")
def scraped(model_dir, tmp_path_factory):
    """Runs the workload under a scraping Prometheus; yields what the checks need."""
    from transformers import AutoTokenizer

    from vllm_kvbm.tools.demo import document

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    doc_a = document(tokenizer, 3000, "typing.py")
    doc_b = document(tokenizer, 3000, "inspect.py")
    # vLLM tokenizes completion prompts with the special tokens
    prompt_tokens = {
        name: len(tokenizer(doc)["input_ids"]) for name, doc in (("A", doc_a), ("B", doc_b))
    }
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "disk").mkdir()
    remote_port = free_port()
    lmcache = start_lmcache_server(remote_port)
    kv = kvbm_transfer_config(
        host_cache_size=HOST_CACHE,
        disk_cache_dir=str(workdir / "disk"),
        disk_cache_size=DISK_CACHE,
        remote_url=f"lm://127.0.0.1:{remote_port}",
        # the peer row's series (no peer is asked: no request names one)
        peer_reads=True,
    )
    try:
        with vllm_server(
            str(MODEL_DIR),
            kv,
            SERVE_ARGS,
            log_path=workdir / "vllm.log",
            env={"VLLM_SERVER_DEV_MODE": "1"},
            startup_timeout=400,
        ) as server:
            target = server.url.removeprefix("http://")
            prometheus = Prometheus(workdir, target)
            try:
                prometheus.wait_ready()
                # Two scrapes before the workload, so every rate has its baseline.
                prometheus.wait_for(
                    'count_over_time(up{job="kvbm"}[1m])',
                    lambda v: v >= 2,
                    60,
                    "Prometheus scraping vllm serve",
                )
                for doc in (doc_a, doc_b, doc_a):
                    server.stream_completion(doc, max_tokens=16)
                served = wait_settled(server)
                # Until Prometheus has scraped the final values of every metric
                for name, value in served.items():
                    prometheus.wait_for(
                        f"sum({name})",
                        lambda v, want=value: v == want,
                        30,
                        f"Prometheus catching up with /metrics {name}",
                    )
                scraped_values = {name: prometheus.value(f"sum({name})") for name in METRICS}
                # B again from the disk tier: the lower-tier read panels get data
                reset_memory_caches(server)
                server.stream_completion(doc_b, max_tokens=16)
                prometheus.wait_for(
                    'sum(kvbm_tier_read_latency_seconds_count{tier="disk"})',
                    lambda v: v >= 1,
                    60,
                    "the disk tier's read scraped",
                )
                yield {
                    "prometheus": prometheus,
                    "served": served,
                    "values": scraped_values,
                    "prompt_tokens": prompt_tokens,
                    "target": target,
                }
            finally:
                prometheus.stop()
    finally:
        stop_process(lmcache)


def test_every_dashboard_query_returns_data(scraped):
    prometheus = scraped["prometheus"]
    dashboard = json.loads(DASHBOARD.read_text())
    targets = dashboard_targets(dashboard)
    assert len(targets) >= 20
    empty, not_finite = [], []
    for title, expr in targets:
        result = prometheus.query(substitute(expr))
        if not result:
            empty.append((title, expr))
        elif not all(math.isfinite(float(r["value"][1])) for r in result):
            not_finite.append((title, expr, [r["value"][1] for r in result]))
    assert not empty, f"queries with no data: {empty}"
    assert not not_finite, f"queries without a number: {not_finite}"
    # the model_name and instance variables' queries (the datasource variable
    # picks which Prometheus every query goes to: this one)
    want = {"model_name": [str(MODEL_DIR)], "instance": [scraped["target"]]}
    variables = dashboard["templating"]["list"]
    assert [v["type"] for v in variables if v["name"] == "datasource"] == ["datasource"]
    assert sorted(v["name"] for v in variables if v["type"] != "datasource") == sorted(want)
    for variable in variables:
        if variable["type"] == "datasource":
            continue
        assert variable["datasource"]["uid"] == "${datasource}", variable["name"]
        query = variable["query"]["query"]
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", query).groups()
        url = f"{prometheus.url}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
            {"match[]": metric}
        )
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert json.load(resp)["data"] == want[variable["name"]], query


def test_counters_match_the_workload(scraped):
    v = scraped["values"]
    n_a, n_b = scraped["prompt_tokens"]["A"], scraped["prompt_tokens"]["B"]
    assert v["vllm:prompt_tokens_total"] == 2 * n_a + n_b

    # The third request: the blocks of A still in the engine's own prefix cache
    # are vLLM hits (A and B share no block); the rest of A's full blocks (at
    # least one token is always left to compute) come from the host tier,
    # which is looked in first.
    local_hits = v["vllm:prefix_cache_hits_total"]
    assert local_hits % BLOCK == 0, local_hits
    local_blocks = int(local_hits // BLOCK)
    expected_onboard = (n_a - 1) // BLOCK - local_blocks
    assert expected_onboard >= 10, (n_a, local_blocks)  # B really pushed A out
    assert v["kvbm_onboard_blocks_total"] == expected_onboard
    assert v['kvbm_matched_tokens_total{tier="host"}'] == expected_onboard * BLOCK
    assert v["vllm:external_prefix_cache_hits_total"] == expected_onboard * BLOCK
    assert v["kvbm_load_latency_seconds_count"] == 1  # one request loaded

    # Looked up: every prompt token beyond the engine's own hits; hit rates
    # are ratios of these counters, summable over replicas
    assert v["vllm:prefix_cache_queries_total"] == 2 * n_a + n_b
    assert v["kvbm_lookup_tokens_total"] == 2 * n_a + n_b - local_hits
    assert v["vllm:external_prefix_cache_queries_total"] == v["kvbm_lookup_tokens_total"]
    # The per-replica window: the three requests are all inside it
    assert v['kvbm_recent_hit_ratio{tier="host"}'] == pytest.approx(
        v['kvbm_matched_tokens_total{tier="host"}'] / v["kvbm_lookup_tokens_total"], rel=1e-12
    )
    assert 0.1 < v['kvbm_recent_hit_ratio{tier="host"}'] < 1
    assert v['kvbm_recent_hit_ratio{tier="disk"}'] == 0
    assert v['kvbm_recent_hit_ratio{tier="remote"}'] == 0

    # Offloaded: the full prompt blocks of A and of B, once each
    offloaded = n_a // BLOCK + n_b // BLOCK
    assert v["kvbm_offload_blocks_total"] == offloaded
    block_bytes = v["kvbm_offload_bytes_total"] / offloaded
    assert block_bytes > 0 and block_bytes == int(block_bytes)
    assert v["kvbm_onboard_bytes_total"] == expected_onboard * block_bytes
    assert v["kvbm_offload_latency_seconds_count"] >= 1
    assert v["kvbm_onboard_latency_seconds_count"] >= 1

    # Written through to the disk and remote tiers (each page once at most),
    # each write timed; both tiers were asked for A's and B's pages
    for tier in ("disk", "remote"):
        assert 0 < v[f'kvbm_tier_write_pages_total{{tier="{tier}"}}'] <= offloaded, tier
        assert v[f'kvbm_tier_write_latency_seconds_count{{tier="{tier}"}}'] >= 1, tier
        assert v[f'kvbm_lookup_latency_seconds_count{{tier="{tier}"}}'] >= 1, tier
    assert v['kvbm_tier_up{tier="remote"}'] == 1

    # Host tier: 1 GiB, holding every offloaded block; the disk tier its
    # configured size, holding some pages
    assert v['kvbm_cache_capacity_bytes{tier="host"}'] == 1 << 30
    assert v['kvbm_cache_capacity_blocks{tier="host"}'] == (1 << 30) // block_bytes
    assert v['kvbm_cache_used_blocks{tier="host"}'] == offloaded
    assert v['kvbm_cache_used_bytes{tier="host"}'] == offloaded * block_bytes
    assert v['kvbm_cache_capacity_bytes{tier="disk"}'] == 512 << 20
    assert 0 < v['kvbm_cache_used_bytes{tier="disk"}'] <= 512 << 20
    assert v[f'kvbm_build_info{{version="{vllm_kvbm.__version__}"}}'] == 1
    assert v["kvbm_page_size_blocks"] == 1  # pages of one block: pages and blocks agree
    for name in ZERO:
        assert v[name] == 0, name


def test_prometheus_holds_what_metrics_endpoint_served(scraped):
    assert scraped["values"] == scraped["served"]


def test_the_alert_rules_evaluate_and_stay_quiet(scraped):
    """Every rule of kvbm-alerts.yml evaluated by this Prometheus on the real
    series: no evaluation error, and no alert pending or firing, since nothing
    failed, dropped or waited in this workload and the remote tier is up."""
    import yaml

    prometheus = scraped["prometheus"]
    names = {
        rule["alert"]
        for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=30) as resp:
            groups = json.load(resp)["data"]["groups"]
        rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
        if set(rules) == names and all(
            r.get("lastEvaluation", "").startswith("2")
            and not r["lastEvaluation"].startswith("0001")
            for r in rules.values()
        ):
            break
        assert time.monotonic() < deadline, f"rules not evaluated: {sorted(rules)}"
        time.sleep(1)
    assert {r["type"] for r in rules.values()} == {"alerting"}
    bad = {name: r.get("lastError") for name, r in rules.items() if r["health"] != "ok"}
    assert not bad, bad
    active = {name: r["state"] for name, r in rules.items() if r["state"] != "inactive"}
    assert not active, active
    # the series the rules read are there: the remote tier's state, the loads' histogram
    assert prometheus.value('sum(kvbm_tier_up{tier="remote"})') == 1
    assert prometheus.value("sum(kvbm_load_latency_seconds_count)") >= 1
