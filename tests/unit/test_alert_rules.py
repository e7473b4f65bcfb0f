"""deploy/prometheus/kvbm-alerts.yml: Prometheus's own checker accepts it, every
series it reads is one KVBM exports (vllm_kvbm/metric_names.py), and each alert
fires on its fault and stays quiet on a healthy replica, evaluated by
`promtool test rules` (Prometheus's rule engine, with its `for` durations) on
synthetic series.

promtool comes with Debian's prometheus package, which scripts/setup_tools.sh
installs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from helpers import ROOT
from vllm_kvbm.metric_names import FAMILIES

pytestmark = pytest.mark.timeout(120)

RULES = ROOT / "deploy" / "prometheus" / "kvbm-alerts.yml"
ALERTS = {
    "KVBMRemoteTierDown",
    "KVBMPoolProcessDown",
    "KVBMCorruptPages",
    "KVBMUnauthenticatedPages",
    "KVBMTierWritesFailing",
    "KVBMTierWritesDropped",
    "KVBMHostTierChurning",
    "KVBMLoadLatencyHigh",
}
# The labels a scrape of vLLM's /metrics gives a KVBM series, and another replica's.
BAD = 'instance="vllm-a:8000", job="vllm", model_name="m", engine="0"'
GOOD = 'instance="vllm-b:8000", job="vllm", model_name="m", engine="0"'
LABELS = {"instance": "vllm-a:8000", "job": "vllm", "model_name": "m"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: run scripts/setup_tools.sh "
            "(it installs Debian's prometheus package, which has it)"
        )
    return path


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_promtool_accepts_the_rules_file():
    proc = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout, proc.stdout


def test_the_checker_refuses_a_broken_rule(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(
        json.dumps(
            {
                "groups": [
                    {
                        "name": "x",
                        "rules": [
                            {"alert": "Broken", "expr": "sum(rate(kvbm_lookup_tokens_total[5m]"}
                        ],
                    }
                ]
            }
        )
    )
    proc = subprocess.run(
        [promtool(), "check", "rules", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0


def test_every_rule_reads_series_kvbm_exports_with_their_tiers():
    samples = {}
    for family in FAMILIES.values():
        for suffix in {
            "counter": ("_total",),
            "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum"),
        }[family.kind]:
            samples[family.name + suffix] = family
    assert {r["alert"] for r in rules()} == ALERTS
    for rule in rules():
        expr = rule["expr"]
        names = set(re.findall(r"\bkvbm_\w+", expr))
        assert names, rule["alert"]
        for name in names:
            assert name in samples, (rule["alert"], name)
        for name, tier in re.findall(r'\b(kvbm_\w+)\{tier="(\w+)"\}', expr):
            assert tier in samples[name].tiers, (rule["alert"], name, tier)
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        page = re.fullmatch(
            r"https://github\.com/vllm-kvbm/vllm-kvbm/blob/main/(docs/[\w-]+\.md)"
            r"(?:#([\w-]+))?",
            rule["annotations"]["runbook_url"],
        )
        assert page and (ROOT / page.group(1)).is_file(), rule["annotations"]["runbook_url"]
        if page.group(2):
            from test_docs_links import anchors

            assert page.group(2) in anchors((ROOT / page.group(1)).read_text()), page.group(0)


def alert(name: str, minutes: int, **labels) -> dict:
    """An alert_rule_test case: ``name`` firing at ``minutes`` with ``labels``
    (none given: quiet)."""
    return {
        "alertname": name,
        "eval_time": f"{minutes}m",
        "exp_alerts": [{"exp_labels": labels}] if labels else [],
    }


def test_each_alert_fires_on_its_fault_and_stays_quiet_when_healthy(tmp_path):
    # The shipped rules without their annotations (promtool compares an
    # alert's annotations as rendered; the expressions, durations and labels
    # are what is under test here, and `check rules` parses the templates).
    stripped = yaml.safe_load(RULES.read_text())
    for group in stripped["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yml").write_text(json.dumps(stripped))
    tiers = ("host", "disk", "remote", "pool")
    per_tier = {tier: f'{{{BAD}, tier="{tier}"}}' for tier in tiers}
    good_tier = {tier: f'{{{GOOD}, tier="{tier}"}}' for tier in tiers}
    series = [
        # the remote server gone from minute 2 on one replica, up on the other
        ("kvbm_tier_up" + per_tier["remote"], "1 1 0x60"),
        ("kvbm_tier_up" + good_tier["remote"], "1x62"),
        # kvbm-pool gone from minute 2 on one replica, answering on the other
        ("kvbm_tier_up" + per_tier["pool"], "1 1 0x60"),
        ("kvbm_tier_up" + good_tier["pool"], "1x62"),
        # one damaged disk page and one unauthenticated remote page at minute 11
        ("kvbm_checksum_failed_pages_total" + per_tier["disk"], "0x10 1x50"),
        ("kvbm_checksum_failed_pages_total" + good_tier["disk"], "0x60"),
        ("kvbm_unauthenticated_pages_total" + per_tier["remote"], "0x10 1x50"),
        ("kvbm_unauthenticated_pages_total" + good_tier["remote"], "0x60"),
        # disk writes failing, remote writes dropped, every minute
        ("kvbm_tier_write_failed_pages_total" + per_tier["disk"], "0+1x60"),
        ("kvbm_tier_write_failed_pages_total" + good_tier["disk"], "0x60"),
        ("kvbm_tier_write_dropped_pages_total" + per_tier["remote"], "0+1x60"),
        ("kvbm_tier_write_dropped_pages_total" + good_tier["remote"], "0x60"),
        # a full host tier of 50 blocks: one replica stores 2 blocks a minute
        # (120 an hour), the other a block every 2 minutes (30 an hour)
        ("kvbm_cache_used_bytes" + per_tier["host"], "99x120"),
        ("kvbm_cache_capacity_bytes" + per_tier["host"], "100x120"),
        ("kvbm_cache_capacity_blocks" + per_tier["host"], "50x120"),
        ("kvbm_evicted_blocks_total" + per_tier["host"], "0+1x120"),
        (f"kvbm_offload_blocks_total{{{BAD}}}", "0+2x120"),
        ("kvbm_cache_used_bytes" + good_tier["host"], "99x120"),
        ("kvbm_cache_capacity_bytes" + good_tier["host"], "100x120"),
        ("kvbm_cache_capacity_blocks" + good_tier["host"], "50x120"),
        ("kvbm_evicted_blocks_total" + good_tier["host"], "0+1x120"),
        (f"kvbm_offload_blocks_total{{{GOOD}}}", "0+0.5x120"),
        # loads of 1-2.5 s on one replica, under 0.5 s on the other
        *[
            (f'kvbm_load_latency_seconds_bucket{{{BAD}, le="{le}"}}', values)
            for le, values in (
                ("0.5", "0x60"),
                ("1", "0x60"),
                ("2.5", "0+10x60"),
                ("+Inf", "0+10x60"),
            )
        ],
        *[
            (f'kvbm_load_latency_seconds_bucket{{{GOOD}, le="{le}"}}', "0+10x60")
            for le in ("0.5", "1", "2.5", "+Inf")
        ],
    ]
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    alert("KVBMRemoteTierDown", 5),  # down 3 minutes: not yet
                    alert(
                        "KVBMRemoteTierDown",
                        10,
                        **LABELS,
                        engine="0",
                        tier="remote",
                        severity="warning",
                    ),
                    alert("KVBMPoolProcessDown", 3),  # down 1 minute: not yet
                    alert(
                        "KVBMPoolProcessDown",
                        5,
                        **LABELS,
                        engine="0",
                        tier="pool",
                        severity="warning",
                    ),
                    alert("KVBMCorruptPages", 10),
                    alert("KVBMCorruptPages", 12, **LABELS, tier="disk", severity="warning"),
                    alert("KVBMCorruptPages", 40),  # no new damage in the last 15 minutes
                    alert(
                        "KVBMUnauthenticatedPages", 12, **LABELS, tier="remote", severity="critical"
                    ),
                    alert("KVBMUnauthenticatedPages", 40),
                    alert("KVBMTierWritesFailing", 10),
                    alert("KVBMTierWritesFailing", 20, **LABELS, tier="disk", severity="warning"),
                    alert("KVBMTierWritesDropped", 20),
                    alert("KVBMTierWritesDropped", 40, **LABELS, tier="remote", severity="warning"),
                    alert("KVBMHostTierChurning", 20),
                    alert(
                        "KVBMHostTierChurning",
                        100,
                        **LABELS,
                        engine="0",
                        tier="host",
                        severity="info",
                    ),
                    alert("KVBMLoadLatencyHigh", 10),
                    alert("KVBMLoadLatencyHigh", 30, **LABELS, severity="warning"),
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(json.dumps(tests))
    proc = subprocess.run(
        [promtool(), "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout
