"""The Grafana dashboard against a real Prometheus scraping a real `vllm serve`.

One `vllm serve` with KVBMConnector and an engine KV cache too small for two
documents runs document A (miss), B (miss, pushes A out of the engine's prefix
cache) and A again (host-tier hit); a Prometheus started here scrapes it every
second. Then every PromQL expression of grafana/dashboards/kvbm.json must return
data through Prometheus's query API, and the counters Prometheus holds must be
what that workload must have caused.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.engines import MODEL_DIR
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server, wait_for_http

pytestmark = pytest.mark.timeout(600)

DASHBOARD = ROOT / "grafana" / "dashboards" / "kvbm.json"
BLOCK = 128
ENGINE_BLOCKS = 28
HOST_CACHE = "1GiB"
SERVE_ARGS = [
    "--enforce-eager", "--block-size", str(BLOCK),
    "--num-gpu-blocks-override", str(ENGINE_BLOCKS),
    "--max-model-len", "3456", "--max-num-batched-tokens", "3456",
    "--gpu-memory-utilization", "0.3",
]
# What Grafana would put in for the dashboard's variables: "All" models, and a
# rate window that covers the whole workload (it runs in a few seconds, and the
# queries follow it at once).
VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
KVBM_COUNTERS = ["matched_tokens", "lookup_tokens", "offload_blocks_d2h",
                 "onboard_blocks_h2d", "offload_bytes_d2h", "onboard_bytes_h2d",
                 "host_evictions", "store_skipped_blocks", "store_errors",
                 "load_error_blocks", "matched_tokens_host", "matched_tokens_disk",
                 "matched_tokens_remote", "onboard_blocks_d2d", "onboard_blocks_remote",
                 "offload_blocks_h2d", "offload_blocks_remote", "tier_write_errors",
                 "tier_write_drops", "tier_read_misses", "tier_read_errors",
                 "checksum_failures", "page_auth_failures", "transfer_timeouts"]
# Zero in this workload: a host tier only (no disk or remote tier), never full.
ZERO_COUNTERS = ["host_evictions", "store_skipped_blocks", "store_errors",
                 "load_error_blocks", "matched_tokens_disk", "matched_tokens_remote",
                 "onboard_blocks_d2d", "onboard_blocks_remote", "offload_blocks_h2d",
                 "offload_blocks_remote", "tier_write_errors", "tier_write_drops",
                 "tier_read_misses", "tier_read_errors", "checksum_failures",
                 "page_auth_failures", "transfer_timeouts"]
# Every value the checks read: from Prometheus, and from /metrics to compare.
METRICS = ([f"kvbm_{name}_total" for name in KVBM_COUNTERS]
           + ["kvbm_offload_latency_seconds_count", "kvbm_onboard_latency_seconds_count",
              "kvbm_host_cache_used_blocks", "kvbm_host_cache_capacity_blocks",
              "kvbm_host_cache_used_bytes", "kvbm_host_cache_capacity_bytes",
              "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate",
              "kvbm_remote_cache_hit_rate",
              "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
              "vllm:external_prefix_cache_hits_total",
              "vllm:external_prefix_cache_queries_total", "vllm:prompt_tokens_total"])


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


class Prometheus:
    def __init__(self, workdir: Path, target: str):
        if shutil.which("prometheus") is None:
            pytest.fail("prometheus is not installed: run scripts/setup.sh "
                        "(it installs Debian's prometheus package)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvbm", "metrics_path": "/metrics",
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for_http(f"{self.url}/-/ready", self.process, timeout, "prometheus",
                      on_exit=self.log_tail, on_timeout=self.log_tail)

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector; raises on a PromQL error."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            raise AssertionError(f"Prometheus rejected {expr!r}: "
                                 f"{err.read().decode(errors='replace')}") from None
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, ok, timeout: float, what: str) -> float | None:
        deadline = time.monotonic() + timeout
        while True:
            value = self.value(expr)
            if value is not None and ok(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {expr} = {value} after {timeout:.0f} s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        self._log.close()


def metrics_values(server) -> dict[str, float]:
    text = server.metrics()
    values = {}
    for name in METRICS:
        pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
        values[name] = sum(float(m.group(2)) for m in pattern.finditer(text))
    return values


def wait_settled(server, timeout: float = 60) -> dict[str, float]:
    """/metrics once the workload's last transfers are counted and nothing moves."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        values = metrics_values(server)
        if values["kvbm_onboard_blocks_h2d_total"] > 0 and values == previous:
            return values
        if time.monotonic() > deadline:
            raise TimeoutError(f"/metrics did not settle after {timeout:.0f} s: {values}")
        previous = values
        time.sleep(2)


@pytest.fixture(scope="module")
def scraped(model_dir, tmp_path_factory):
    """Runs the workload under a scraping Prometheus; yields what the checks need."""
    from transformers import AutoTokenizer

    from vllm_kvbm.tools.demo import document

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    doc_a = document(tokenizer, 3000, "typing.py")
    doc_b = document(tokenizer, 3000, "inspect.py")
    # vLLM tokenizes completion prompts with the special tokens
    prompt_tokens = {name: len(tokenizer(doc)["input_ids"])
                     for name, doc in (("A", doc_a), ("B", doc_b))}
    workdir = tmp_path_factory.mktemp("prometheus")
    with vllm_server(str(MODEL_DIR), kvbm_transfer_config(host_cache_size=HOST_CACHE),
                     SERVE_ARGS, log_path=workdir / "vllm.log", startup_timeout=400) as server:
        prometheus = Prometheus(workdir, server.url.removeprefix("http://"))
        try:
            prometheus.wait_ready()
            # Two scrapes before the workload, so every rate has its baseline.
            prometheus.wait_for('count_over_time(up{job="kvbm"}[1m])', lambda v: v >= 2,
                                60, "Prometheus scraping vllm serve")
            for doc in (doc_a, doc_b, doc_a):
                server.stream_completion(doc, max_tokens=16)
            served = wait_settled(server)
            # Until Prometheus has scraped the final values of every metric
            for name, value in served.items():
                prometheus.wait_for(f"sum({name})", lambda v, want=value: v == want, 30,
                                    f"Prometheus catching up with /metrics {name}")
            scraped_values = {name: prometheus.value(f"sum({name})") for name in METRICS}
            yield {"prometheus": prometheus, "served": served, "values": scraped_values,
                   "prompt_tokens": prompt_tokens}
        finally:
            prometheus.stop()


def test_dashboard_has_the_expected_rows_and_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvbm"
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    for word in ("hit rate", "Offload D2H", "Onboard H2D", "latency", "Host tier",
                 "Evictions"):
        assert any(word.lower() in row.lower() for row in rows), (word, rows)
    exprs = " ".join(expr for _, expr in dashboard_targets(dashboard))
    from vllm_kvbm.metrics import COUNTERS, GAUGES, HISTOGRAMS

    # A metric added to vllm_kvbm/metrics.py needs a panel too.
    missing = [f"kvbm_{name}_total" for name in COUNTERS if f"kvbm_{name}_total" not in exprs]
    missing += [f"kvbm_{name}" for name in GAUGES if f"kvbm_{name}" not in exprs]
    assert not missing, f"metrics of vllm_kvbm/metrics.py without a panel in {DASHBOARD}: {missing}"
    for name in HISTOGRAMS:
        for quantile in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (le) (rate(kvbm_{name}_bucket" \
                in exprs, (name, quantile)
    for name in ("vllm:external_prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        assert name in exprs, name


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
    # the model_name variable's query (the datasource variable picks which
    # Prometheus every query goes to: this one)
    variables = dashboard["templating"]["list"]
    assert [v["type"] for v in variables if v["name"] == "datasource"] == ["datasource"]
    for variable in variables:
        if variable["type"] == "datasource":
            continue
        assert variable["datasource"]["uid"] == "${datasource}", variable["name"]
        query = variable["query"]["query"]
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", query).groups()
        url = (f"{prometheus.url}/api/v1/label/{label}/values?"
               + urllib.parse.urlencode({"match[]": metric}))
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert json.load(resp)["data"] == [str(MODEL_DIR)], query


def test_counters_match_the_workload(scraped):
    v = scraped["values"]
    n_a, n_b = scraped["prompt_tokens"]["A"], scraped["prompt_tokens"]["B"]
    assert v["vllm:prompt_tokens_total"] == 2 * n_a + n_b

    # The third request: the blocks of A still in the engine's own prefix cache
    # are vLLM hits (A and B share no block); the rest of A's full blocks (at
    # least one token is always left to compute) come from the host tier.
    local_hits = v["vllm:prefix_cache_hits_total"]
    assert local_hits % BLOCK == 0, local_hits
    local_blocks = int(local_hits // BLOCK)
    expected_onboard = (n_a - 1) // BLOCK - local_blocks
    assert expected_onboard >= 10, (n_a, local_blocks)  # B really pushed A out
    assert v["kvbm_onboard_blocks_h2d_total"] == expected_onboard
    assert v["kvbm_matched_tokens_total"] == expected_onboard * BLOCK
    assert v["kvbm_matched_tokens_host_total"] == expected_onboard * BLOCK
    assert v["vllm:external_prefix_cache_hits_total"] == expected_onboard * BLOCK

    # Looked up: every prompt token beyond the engine's own hits
    assert v["vllm:prefix_cache_queries_total"] == 2 * n_a + n_b
    assert v["kvbm_lookup_tokens_total"] == 2 * n_a + n_b - local_hits
    assert v["vllm:external_prefix_cache_queries_total"] == v["kvbm_lookup_tokens_total"]
    # Dynamo's gauges: the three requests are all inside their 1000-request window
    assert v["kvbm_host_cache_hit_rate"] == pytest.approx(
        v["kvbm_matched_tokens_host_total"] / v["kvbm_lookup_tokens_total"], rel=1e-12)
    assert 0.1 < v["kvbm_host_cache_hit_rate"] < 1
    assert v["kvbm_disk_cache_hit_rate"] == v["kvbm_remote_cache_hit_rate"] == 0

    # Offloaded: the full prompt blocks of A and of B, once each
    offloaded = n_a // BLOCK + n_b // BLOCK
    assert v["kvbm_offload_blocks_d2h_total"] == offloaded
    block_bytes = v["kvbm_offload_bytes_d2h_total"] / offloaded
    assert block_bytes > 0 and block_bytes == int(block_bytes)
    assert v["kvbm_onboard_bytes_h2d_total"] == expected_onboard * block_bytes
    assert v["kvbm_offload_latency_seconds_count"] >= 1
    assert v["kvbm_onboard_latency_seconds_count"] >= 1

    # Host tier: 1 GiB, holding every offloaded block; nothing evicted, skipped,
    # failed, or in a lower tier
    assert v["kvbm_host_cache_capacity_bytes"] == 1 << 30
    assert v["kvbm_host_cache_capacity_blocks"] == (1 << 30) // block_bytes
    assert v["kvbm_host_cache_used_blocks"] == offloaded
    assert v["kvbm_host_cache_used_bytes"] == offloaded * block_bytes
    for name in ZERO_COUNTERS:
        assert v[f"kvbm_{name}_total"] == 0, name


def test_prometheus_holds_what_metrics_endpoint_served(scraped):
    assert scraped["values"] == scraped["served"]
