"""grafana/dashboards/kvbm.json reads every exported metric, per replica.

(tests/e2e/test_prometheus_dashboard.py runs every query against a real
Prometheus scraping a real `vllm serve`.)"""

from __future__ import annotations

import json
import re

from helpers import ROOT
from vllm_kvbm.metric_names import FAMILIES

DASHBOARD = ROOT / "grafana" / "dashboards" / "kvbm.json"
# Panels that add replicas up on purpose: latency distributions and totals
TOGETHER = ("latency", "together", "(total)")


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every target, rows' nested panels included."""
    found: list[tuple[str, dict]] = []

    def walk(panels):
        for panel in panels:
            found.extend((panel["title"], t) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_has_a_panel():
    exprs = " ".join(t["expr"] for _, t in targets(load()))
    missing = [
        f.name
        for f in FAMILIES.values()
        if not re.search(rf"\b{f.name}(_total|_bucket|_count)?\b", exprs)
    ]
    assert not missing, f"metrics without a panel in {DASHBOARD}: {missing}"
    for family in FAMILIES.values():
        if family.kind != "histogram":
            continue
        by = "le, tier" if family.tiers else "le"
        for quantile in ("0.5", "0.9", "0.99"):
            assert (
                f"histogram_quantile({quantile}, sum by ({by}) (rate({family.name}_bucket"
            ) in exprs, (family.name, quantile)


def test_rows_cover_the_operators_questions():
    rows = [p["title"] for p in load()["panels"] if p["type"] == "row"]
    for word in (
        "hit rate",
        "Offload D2H",
        "Onboard H2D",
        "Lower tiers",
        "Latency",
        "Host tier",
        "Evictions",
        "learned costs",
        "time to first token",
    ):
        assert any(word.lower() in row.lower() for row in rows), (word, rows)


def test_an_instance_variable_selects_replicas():
    dashboard = load()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    instance = variables["instance"]
    assert instance["query"]["query"] == "label_values(kvbm_build_info, instance)"
    assert instance["includeAll"] and instance["multi"] and instance["allValue"] == ".*"
    for title, target in targets(dashboard):
        # every selector of a metric filters by both variables
        for selector in re.findall(r"\b(?:kvbm|vllm:)\w*\{([^}]*)\}", target["expr"]):
            assert 'instance=~"$instance"' in selector, (title, target["expr"])
            assert 'model_name=~"$model_name"' in selector, (title, target["expr"])
        assert not re.search(r"\b(?:kvbm|vllm:)\w*\[", target["expr"]), (title, target["expr"])


def test_panels_draw_one_line_per_replica():
    """Grouped by instance and engine (and tier), not summed into one line,
    except the panels that add replicas up on purpose."""
    per_replica = 0
    for title, target in targets(load()):
        if any(word in title.lower() for word in TOGETHER):
            continue
        assert "{{instance}}" in target["legendFormat"], title
        assert "{{engine}}" in target["legendFormat"], title
        groupings = re.findall(r"\b(?:sum|max) by \(([^)]*)\)", target["expr"])
        assert groupings, (title, target["expr"])
        for grouping in groupings:
            labels = {label.strip() for label in grouping.split(",")}
            assert {"instance", "engine"} <= labels, (title, target["expr"])
            if "{{tier}}" in target["legendFormat"]:
                assert "tier" in labels or "group_left" in target["expr"], title
        per_replica += 1
    assert per_replica >= 30
