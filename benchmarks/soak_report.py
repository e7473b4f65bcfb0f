"""The soak's verdict: the counters it reads after the run (once the engine
is idle), its summary and the checks that decide its exit status
(benchmarks/soak.py runs it)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from soak import SoakConfig, SoakResult

COUNTERS = {
    "kvbm_matched_tokens_total": "kvbm matched tokens",
    "kvbm_onboard_blocks_total": "blocks onboarded",
    "kvbm_offload_blocks_total": "blocks offloaded",
    "kvbm_evicted_blocks_total": "host evictions",
    "kvbm_offload_skipped_blocks_total": "stores skipped",
    "kvbm_offload_failed_transfers_total": "store errors",
    "kvbm_onboard_failed_blocks_total": "load error blocks",
    "vllm:external_prefix_cache_hits_total": "external hit tokens",
    "vllm:prefix_cache_hits_total": "local prefix hit tokens",
    "vllm:num_preemptions_total": "preemptions",
}
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def _settle(server, timeout: float) -> tuple[dict[str, float], str]:
    """Waits (bounded) for the engine to drain and vLLM's logging interval to
    publish the connector's counters; returns them and what was still busy."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        counters = {name: server.metric(name) for name in COUNTERS}
        gauges = {name: server.metric(name) for name in IDLE_GAUGES}
        idle = not any(gauges.values())
        if idle and counters == last:
            return counters, ""
        if time.monotonic() > deadline:
            busy = "" if idle else ", ".join(f"{k} {v:g}" for k, v in gauges.items())
            return counters, busy
        last = counters
        time.sleep(5)


def summary(result: SoakResult, cfg: SoakConfig) -> str:
    done = sorted(lat for lat in result.latencies if lat > 0)
    pct = (lambda q: done[min(len(done) - 1, int(q * len(done)))]) if done else (lambda q: 0)
    c = result.counters
    lines = [
        f"soak: {len(result.requests)} requests "
        f"({len({tuple(r.prompt) for r in result.requests})} distinct prompts), "
        f"concurrency {cfg.concurrency}, {'KVBM' if cfg.kvbm else 'plain (no connector)'}; "
        f"engine {cfg.engine_blocks} blocks, host {cfg.host_blocks} blocks",
        f"wall {result.wall_s:.1f} s; latency p50 {pct(0.5):.2f} s, p99 {pct(0.99):.2f} s, "
        f"max {done[-1] if done else 0:.2f} s",
        f"checked {len(done)}, cancelled by the client {len(result.cancelled)}, "
        f"errors/hangs {len(result.errors)}, wrong outputs {len(result.mismatches)}"
        + (f", engine not idle after the run: {result.not_idle}" if result.not_idle else ""),
        f"host-tier hits: {c.get('kvbm_onboard_blocks_total', 0):.0f} blocks onboarded "
        f"({c.get('vllm:external_prefix_cache_hits_total', 0):.0f} tokens); "
        f"evictions {c.get('kvbm_evicted_blocks_total', 0):.0f}",
        "; ".join(f"{label} {c.get(name, 0):.0f}" for name, label in COUNTERS.items()),
    ]
    if result.resets:
        outcomes: dict[str, int] = {}
        for _, outcome in result.resets:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        lines.append(
            f"cache resets under traffic: {len(result.resets)} ("
            + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            + ")"
            + (
                f"; after the run: {result.after_reset}"
                if result.after_reset
                else "; after the run: nothing onboarded after a full reset"
            )
        )
    for i, err in sorted(result.errors.items())[:5]:
        lines.append(f"  request {i}: {err}")
    for i in result.mismatches[:5]:
        lines.append(
            f"  request {i} (prompt of {len(result.requests[i].prompt)} tokens): "
            f"got {result.outputs[i]}"
        )
    return "\n".join(lines)


def check(result: SoakResult, cfg: SoakConfig) -> list[str]:
    """The soak's pass conditions; returns what failed."""
    problems = []
    if result.errors:
        problems.append(f"{len(result.errors)} requests failed or hung")
    if result.mismatches:
        problems.append(f"{len(result.mismatches)} outputs differ from the reference")
    if result.not_idle:
        problems.append(
            f"engine still busy {cfg.idle_timeout:.0f} s after the last request: {result.not_idle}"
        )
    if cfg.reset_every > 0:
        if not any(outcome == "ok" for _, outcome in result.resets):
            problems.append(f"no cache reset succeeded during the run ({len(result.resets)} tried)")
        broken = [o for _, o in result.resets if o not in ("ok", "refused")]
        if broken:
            problems.append(f"{len(broken)} reset calls failed: {broken[0]}")
        if result.after_reset:
            problems.append(result.after_reset)
    if cfg.kvbm:
        c = result.counters
        if c.get("kvbm_onboard_blocks_total", 0) <= 0:
            problems.append("no block was onboarded from the host tier")
        if c.get("kvbm_evicted_blocks_total", 0) <= 0:
            problems.append("the host tier never evicted")
        if c.get("kvbm_onboard_failed_blocks_total", 0) != 0:
            problems.append("load errors happened")
        if c.get("kvbm_offload_failed_transfers_total", 0) != 0:
            problems.append("store errors happened")
    return problems
