"""``kvbm-bench compare``'s report: one Markdown table of every configuration,
TTFT per round and arrival (alone or queued, ``arrivals.py``), both clients
side by side, and why each failure happened."""

from __future__ import annotations

import math
import os

from vllm_kvbm.bench.arrivals import ALL, CLASSES
from vllm_kvbm.bench.client import workload_size
from vllm_kvbm.bench.compare import (
    NATIVE_CONNECTORS,
    ConfigRun,
    config_serve_args,
    offload_bytes,
    unequal_cores,
)
from vllm_kvbm.bench.lmbenchmark import LMB_CLIENT, lmbenchmark_time
from vllm_kvbm.bench.serve_args import serve_args


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def _gain(base: dict, s: dict) -> str:
    b, x = base.get("ttft_mean_s"), s.get("ttft_mean_s")
    return f"{b / x:.1f}x" if b and x and not math.isnan(b) and not math.isnan(x) else "-"


def hit_tokens(r: ConfigRun) -> str:
    """The prompt tokens a connector found: KVBM's per tier, LMCache's."""
    c = r.counters
    if "kvbm_tokens" in c:
        tiers = {t: n for t, n in c["kvbm_tokens"].items() if n or t in ("host", "disk")}
        return ", ".join(f"{t} {n:.0f}" for t, n in tiers.items()) or "0"
    if "lmcache_hit_tokens" in c:
        return f"{c['lmcache_hit_tokens']}"
    return "-"


def _setup(runs: list[ConfigRun], args) -> list[str]:
    if getattr(args, "url", None):
        return [
            f"Model `{args.model}` on servers kvbm-bench did not start: "
            + ", ".join(f"{n} {u}" for n, u in args.url)
            + ". The cores of a server on "
            "this machine are read from the process listening on its port; a server "
            'elsewhere shows "-".',
            "",
        ]
    env = " ".join(f"{k}={v}" for k, v in args.cpu_env.items())
    lines = [
        f"Model `{args.model}`; serve args `{' '.join(serve_args(args))}` "
        f"(`--serve-defaults {getattr(args, 'serve_defaults', None) or 'cpu'}`); every "
        f"server started with `{env}` on a {os.cpu_count()}-core machine.",
        "",
    ]
    native = [r.name for r in runs if r.name == "vllm-offload" or r.name in NATIVE_CONNECTORS]
    if native:
        size = offload_bytes(args)
        lines += [
            f"vLLM's own offloading ({', '.join(native)}) gets {args.host_cache_size} of "
            f"host RAM: `{' '.join(config_serve_args('vllm-offload', args)[-4:])}`, or "
            f"`cpu_bytes_to_use: {size}` in the connector's kv_connector_extra_config.",
            "",
        ]
    return lines


def _row(r: ConfigRun, args) -> str:
    cores = r.binding.describe() if r.binding else "-"
    s, c = r.summary, r.counters
    planned = workload_size(args)
    if r.status == "ok" or s:
        hit = f"{c['prefix_hits'] / c['prefix_queries']:.0%}" if c.get("prefix_queries") else "-"
        # a server that ran while its connector logged errors (LMCache's
        # manager not initialized on the CPU build): its figures are not the
        # connector's
        status = f"{r.status}, errors in its log (below)" if r.log_errors else r.status
        return (
            f"| {r.label} | {status} | {cores} | {s['requests']}/{planned} | "
            f"{s.get('max_in_flight', '-')} | {_ms(s['ttft_mean_s'])} | "
            f"{_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p90_s'])} | {_ms(s['ttft_p99_s'])} | "
            f"{s['input_tokens_per_s']:.0f} | {s['output_tokens_per_s']:.1f} | "
            f"{hit} | {hit_tokens(r)} |"
        )
    status = (
        r.reason
        if r.status == "not supported"
        else f"does not start: {r.reason}"
        if r.reason
        else "failed: see below"
    )
    return (
        f"| {r.label} | {status.replace('|', '/')} | {cores} | 0/{planned} | - | - | - "
        "| - | - | - | - | - | - |"
    )


def by_round_arrival(runs: list[ConfigRun], workload: str) -> list[str]:
    """TTFT per round (or pass) and arrival class, every configuration side
    by side, and the baseline's mean over each other configuration's (vLLM's
    own prefix cache when it ran, else the first configuration)."""
    ran = [r for r in runs if r.summary.get("ttft_by_round_arrival")]
    if not ran:
        return []
    base = next((r for r in ran if r.name == "vllm"), ran[0])
    others = [r for r in ran if r is not base]
    what = "round" if workload == "multi-round" else "pass"
    keys = list(dict.fromkeys(k for r in ran for k in r.summary["ttft_by_round_arrival"]))
    lines = [
        "",
        f"TTFT (ms) per {what} (`question_id`) and arrival: **alone**, sent while no "
        "other request of the run was in flight; **queued**, sent while at least one was "
        "(sent, its last token not yet received), so its prefill waited or shared the "
        "engine's steps. Each configuration's classes come from its own run's timings. "
        f"{base.label} / X: {base.label}'s mean TTFT over X's.",
        "",
        f"| {what} | arrival | "
        + " | ".join(f"{r.label} requests | mean | p50 | p90" for r in ran)
        + "".join(f" | {base.name} / {r.name}" for r in others)
        + " |",
        "|---|---|" + "---:|" * (4 * len(ran) + len(others)),
    ]
    for key in keys:
        for cls in CLASSES:
            cells = [r.summary["ttft_by_round_arrival"].get(key, {}).get(cls, {}) for r in ran]
            if not any(c.get("requests") for c in cells):
                continue
            row = [f"{what} {key}" if key != ALL else f"every {what}", cls]
            for c in cells:
                row += [
                    str(c.get("requests", 0)),
                    _ms(c.get("ttft_mean_s")),
                    _ms(c.get("ttft_p50_s")),
                    _ms(c.get("ttft_p90_s")),
                ]
            b = cells[ran.index(base)].get("ttft_mean_s")
            row += [_ratio(b, c.get("ttft_mean_s")) for r, c in zip(ran, cells) if r is not base]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _ratio(base: float | None, x: float | None) -> str:
    return f"{base / x:.1f}x" if base and x else "-"


def _lmbenchmark(runs: list[ConfigRun], args) -> list[str]:
    base = next((r for r in runs if r.name == "vllm"), None)
    lines = [
        "",
        f"Both clients against the same servers: kvbm-bench's run above, then "
        f"LMBenchmark's `{LMB_CLIENT}` (checkout `{args.lmbenchmark_dir}`) with the same "
        f"users, rounds, QPS and lengths for {lmbenchmark_time(args)} s (its own "
        "prompts, its own pacing: its first sessions start mid-conversation, and "
        "requests unfinished at the deadline are dropped). Gain: vLLM's mean TTFT "
        "over this configuration's, per client.",
        "",
        "| configuration | kvbm-bench mean TTFT ms | gain | max in flight "
        "| LMBenchmark mean TTFT ms | gain | requests | max in flight |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        s, m = r.summary, r.lmb_summary
        lines.append(
            f"| {r.label} | {_ms(s.get('ttft_mean_s'))} | "
            f"{_gain(base.summary, s) if base else '-'} | {s.get('max_in_flight', '-')} | "
            f"{_ms(m.get('ttft_mean_s'))} | {_gain(base.lmb_summary, m) if base else '-'} | "
            f"{m.get('requests', '-')} | {m.get('max_in_flight', '-')} |"
        )
    for r in runs:
        if r.lmb_error:
            lines += [
                "",
                f"LMBenchmark against **{r.label}**:",
                "",
                "```",
                r.lmb_error.strip(),
                "```",
            ]
    return lines


def _failures(runs: list[ConfigRun]) -> list[str]:
    lines = []
    for r in runs:
        if r.status == "not supported":
            continue  # its row says why; nothing was started
        if r.reason:  # one line from the log, not its tracebacks
            lines += [
                "",
                f"**{r.label}** did not start (after {r.wall_s:.0f} s); the "
                "cause in its server log:",
                "",
                "```",
                r.reason,
                "```",
                "",
                "; ".join(ln.split("; errors in ")[0] for ln in r.error.strip().splitlines()) + ".",
            ]
        elif r.error:
            lines += [
                "",
                f"**{r.label}** ({r.status}, after {r.wall_s:.0f} s):",
                "",
                "```",
                r.error.strip(),
                "```",
            ]
    for r in runs:
        if r.log_errors and not r.error:
            lines += [
                "",
                f"Error lines in the server log of **{r.label}** "
                "(the server ran; distinct lines, last ones):",
                "",
                "```",
                r.log_errors.strip(),
                "```",
            ]
    return lines


def report(runs: list[ConfigRun], args, command: str) -> str:
    lines = [f"# kvbm-bench compare: {args.workload}", ""]
    problem = unequal_cores(runs)
    if problem:
        lines += [
            f"**NOT COMPARABLE: {problem}.** Set the same VLLM_CPU_OMP_THREADS_BIND "
            "for every configuration and run again.",
            "",
        ]
    lines += [f"Command: `{command}`", "", *_setup(runs, args)]
    lines += [
        "| configuration | status | cores | requests | max in flight "
        "| TTFT mean ms | p50 | p90 | p99 | input tok/s | output tok/s "
        "| vLLM prefix hit rate | connector hit tokens |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(r, args) for r in runs]
    lines += by_round_arrival(runs, args.workload)
    if args.lmbenchmark_dir:
        lines += _lmbenchmark(runs, args)
    lines += _failures(runs)
    lines += [
        "",
        "Wall time per configuration (server start, warm-up, workload, stop): "
        + ", ".join(f"{r.name} {r.wall_s:.0f} s" for r in runs)
        + ". "
        "1-minute load average at the start and end of kvbm-bench's workload (other "
        "work on the machine shows here): "
        + ", ".join(f"{r.name} {r.load[0]:.1f} / {r.load[1]:.1f}" for r in runs if r.load)
        + ".",
    ]
    return "\n".join(lines) + "\n"
