"""The kvbm_recent_hit_ratio gauges: each engine's hit ratio per tier over its
last admitted requests (Dynamo KVBM's window and meaning), per replica.

Fed by what the planner counts when vLLM's real Scheduler admits a request,
read back from KVBMStats, from the payload vLLM collects, and from a real
standalone /metrics endpoint.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from helpers.scheduler_harness import BLOCK, kvbm, make_request, make_scheduler, step
from helpers.scheduler_harness import admit as admit_request
from helpers.scheduler_harness import keys_of, store_and_finish
from helpers.tier_pages import disk_store_for, put_where_the_scheduler_sees
from vllm_kvbm import metrics
from vllm_kvbm.metric_names import FAMILIES
from vllm_kvbm.metrics import KVBMStats, StandaloneMetrics
from vllm_kvbm.tools.server import free_port

RATES = ("host_cache_hit_rate", "disk_cache_hit_rate", "remote_cache_hit_rate")


def tokens(n: int, base: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def admit(stats: KVBMStats, lookup: int, **matched: int) -> None:
    """What the planner adds when vLLM admits one request."""
    stats.add("lookup_tokens", lookup)
    stats.add("matched_tokens", sum(matched.values()))
    for tier, tokens_ in matched.items():
        for _ in range(tokens_ // BLOCK):
            stats.add(f"matched_tokens_{tier}", BLOCK)


def rates(stats: KVBMStats) -> tuple[float | None, ...]:
    """Each tier's gauge; None for a tier the engine does not have."""
    return tuple(stats.gauges.get(name) for name in RATES)


def test_gauges_say_what_they_measure_and_that_they_are_per_replica():
    family = FAMILIES["kvbm_recent_hit_ratio"]
    assert family.kind == "gauge" and family.tiers == ("host", "pool", "disk", "peer", "remote")
    assert "tokens found in the tier / tokens looked up" in family.doc
    assert f"last {metrics.HIT_RATE_WINDOW} admitted requests" in family.doc
    assert "Per replica" in family.doc and "divide the token counters" in family.doc
    assert metrics.HIT_RATE_WINDOW == 1000  # Dynamo's DYN_KVBM_CACHE_STATS_MAX_REQUESTS default
    # Dynamo's device->disk direct offload does not exist in KVBM (docs/metrics.md)
    assert "offload_blocks_d2d" not in metrics.COUNTERS


def test_host_hit_rate_through_vllms_scheduler():
    """A prompt stored by one request and loaded by the next, after vLLM's own
    prefix cache forgot it: 2 of its 40 tokens' blocks come from the host tier."""
    sched = make_scheduler()
    k = kvbm(sched)
    prompt = tokens(40, 21)  # 2 full blocks + an 8-token tail
    store_and_finish(sched, prompt)
    assert rates(k.stats) == (0.0, None, None)  # looked up 40 tokens, found none; host only
    assert sched.reset_prefix_cache()
    sched.add_request(make_request(prompt, max_tokens=2))
    _, meta, _ = step(sched)
    assert len(meta.loads) == 1

    assert k.stats.total["lookup_tokens"] == 80 and k.stats.total["matched_tokens_host"] == 32
    assert rates(k.stats) == (32 / 80, None, None)


def test_disk_hit_rate_through_vllms_scheduler(tmp_path):
    sched = make_scheduler(host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    store = disk_store_for(k, tmp_path)
    try:
        prompt = tokens(3 * BLOCK + 5, 22)
        keys = keys_of(sched, prompt)
        put_where_the_scheduler_sees(store, k, keys[:2])  # two of three full blocks on disk
        req = make_request(prompt, max_tokens=2)
        sched.add_request(req)
        admit_request(sched, req)
        assert rates(k.stats) == (0.0, 2 * BLOCK / len(prompt), None)  # no remote tier
    finally:
        store.close()


def test_rates_cover_the_last_window_of_requests(monkeypatch):
    monkeypatch.setattr(metrics, "HIT_RATE_WINDOW", 3)
    stats = KVBMStats()
    admit(stats, 100, host=64)
    admit(stats, 100, disk=32, remote=16)
    assert rates(stats) == (64 / 200, 32 / 200, 16 / 200)
    # what vLLM collects each step carries them (only when they changed)
    gauges = stats.take()["gauges"]
    assert [gauges[name] for name in RATES] == [64 / 200, 32 / 200, 16 / 200]
    assert "gauges" not in stats.take()
    admit(stats, 200)
    assert rates(stats) == (64 / 400, 32 / 400, 16 / 400)
    admit(stats, 100, host=96)  # the first request leaves the window
    assert rates(stats) == (96 / 400, 32 / 400, 16 / 400)
    admit(stats, 50)
    admit(stats, 50)  # only misses are left
    assert rates(stats) == (96 / 200, 0.0, 0.0)
    admit(stats, 50)
    assert rates(stats) == (0.0, 0.0, 0.0)


def test_rates_on_the_standalone_metrics_port():
    port = free_port()
    sink = StandaloneMetrics(port, "127.0.0.1")
    try:
        stats = KVBMStats(sink)
        admit(stats, 256, host=128, disk=64)
        admit(stats, 256, remote=32)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        values = {
            tier: float(value)
            for tier, value in re.findall(
                r'^kvbm_recent_hit_ratio\{tier="(\w+)"\} (\S+)$', text, re.M
            )
        }
        assert values == {
            "host": 128 / 512,
            "pool": 0.0,
            "disk": 64 / 512,
            "peer": 0.0,
            "remote": 32 / 512,
        }
        assert "# TYPE kvbm_recent_hit_ratio gauge" in text
    finally:
        sink.close()


@pytest.mark.parametrize("name", ["lookup_tokens", "matched_tokens_host"])
def test_zero_adds_change_nothing(name):
    stats = KVBMStats()
    admit(stats, 100, host=32)
    before = rates(stats)
    stats.add(name, 0)
    assert rates(stats) == before
