"""Runs one workload against several server configurations, one after another.

    kvbm-bench compare                       # the local model, all configurations
    python -m vllm_kvbm.bench.compare --model PATH --configs vllm kvbm-host

For each configuration: start ``vllm serve`` (same model, same serve args, an
engine KV cache too small for the working set, the same CPU binding
environment), send a warm-up request, run the workload, read the server's
counters, then, with ``--lmbenchmark-dir`` (or LMBENCHMARK_DIR), run the real
LMBenchmark client (``synthetic-multi-round-qa/multi-round-qa.py``) against the
same server with the same sizes, and stop the server. The cores each server's
OpenMP threads ran on are read from its log (``cores.py``): a comparison whose
configurations ran on different cores is marked as not comparable and exits 3.
vLLM's own CPU offloading runs as three configurations: ``--kv-offloading-size``
(``--kv-offloading-backend native``: vLLM picks the OffloadingConnector, or the
SimpleCPUOffloadConnector with VLLM_USE_SIMPLE_KV_OFFLOAD=1) and each of those
two connectors named in ``--kv-transfer-config``; all get ``--host-cache-size``
of host RAM, as KVBM's host tier does. A configuration that cannot run on this
platform (vLLM's offloading and LMCache's connector on vLLM's CPU build) is
marked "not supported" with the reason, not started (``--run-unsupported``
starts it anyway); one that fails to start is reported with the root-cause line
of its server log instead of being left out, and the next one runs. Writes,
under ``--out-dir``: per-configuration CSV and summary JSON, server logs,
``report.md`` (one comparison table) and two PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvbm.bench.client import (HelpFormatter, add_workload_args, format_summary,
                                    run_workload, summarize, workload_size, write_csv)
from vllm_kvbm.bench.cores import Binding, check_equal, fair_cpu_env, read_binding
from vllm_kvbm.bench.lmbenchmark import (LMB_CLIENT, lmbenchmark_problem, lmbenchmark_time,
                                         run_lmbenchmark)
from vllm_kvbm.bench.platforms import unsupported_here
from vllm_kvbm.bench.server_logs import log_errors, startup_error
from vllm_kvbm.config import parse_size
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server, wait_port_free

LMCACHE_CONFIG = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
# vLLM's own CPU offloading: the serve flag and the two connectors it can pick
NATIVE_CONNECTORS = {"offloading-connector": "OffloadingConnector",
                     "simple-cpu-offload": "SimpleCPUOffloadConnector"}
ALL_CONFIGS = ["vllm", "kvbm-host", "kvbm-host-disk", "vllm-offload", *NATIVE_CONNECTORS,
               "lmcache"]
LABELS = {
    "vllm": "vLLM prefix caching",
    "kvbm-host": "vLLM + KVBM (host)",
    "kvbm-host-disk": "vLLM + KVBM (host+disk)",
    "vllm-offload": "vLLM --kv-offloading-size (native)",
    "offloading-connector": "vLLM + OffloadingConnector",
    "simple-cpu-offload": "vLLM + SimpleCPUOffloadConnector",
    "lmcache": "vLLM + LMCacheConnectorV1",
}
METRICS = {
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "kvbm_host_tokens": ("kvbm_matched_tokens_total", {"tier": "host"}),
    "kvbm_disk_tokens": ("kvbm_matched_tokens_total", {"tier": "disk"}),
    "kvbm_onboarded_blocks": "kvbm_onboard_blocks_total",
}


def _metric(server, metric: "str | tuple[str, dict[str, str]]") -> float:
    name, labels = (metric, {}) if isinstance(metric, str) else metric
    return server.metric(name, **labels)


@dataclass
class ConfigRun:
    name: str
    status: str = "not run"          # ok | incomplete | failed | did not start | not supported
    error: str = ""
    reason: str = ""                 # one line: why a server did not start
    log_errors: str = ""             # distinct error lines of a server that did run
    summary: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    wall_s: float = 0.0
    binding: Binding | None = None   # the cores its OpenMP threads ran on (server log)
    lmb_summary: dict = field(default_factory=dict)  # the real LMBenchmark client's run
    lmb_error: str = ""
    load: tuple = ()                 # 1-minute load average at the workload's start and end


def transfer_config(name: str, args, out_dir: Path) -> dict | None:
    if name == "vllm":
        return None
    if name == "kvbm-host":
        return kvbm_transfer_config(host_cache_size=args.host_cache_size)
    if name == "kvbm-host-disk":
        disk = out_dir / "disk-tier"
        disk.mkdir(parents=True, exist_ok=True)
        return kvbm_transfer_config(host_cache_blocks=args.host_disk_host_blocks,
                                    disk_cache_dir=str(disk.resolve()),
                                    disk_cache_size=args.disk_cache_size)
    if name == "lmcache":
        return dict(LMCACHE_CONFIG)
    if name == "vllm-offload":
        return None  # the serve flags below configure it
    if name in NATIVE_CONNECTORS:
        return {"kv_connector": NATIVE_CONNECTORS[name], "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": offload_bytes(args)}}
    raise ValueError(f"unknown configuration {name!r}; choose from {ALL_CONFIGS}")


def offload_bytes(args) -> int:
    """vLLM's offloading gets the host RAM KVBM's host tier gets (one engine,
    one worker: vLLM's size is per engine, KVBM's per worker)."""
    return parse_size("--host-cache-size", args.host_cache_size)


def config_serve_args(name: str, args) -> list[str]:
    """The serve arguments of one configuration: the common ones, and the
    offloading flags for vllm-offload (in GiB, as vLLM reads them)."""
    extra = []
    if name == "vllm-offload":
        extra = ["--kv-offloading-size", f"{offload_bytes(args) / (1 << 30):g}",
                 "--kv-offloading-backend", "native"]
    return serve_args(args) + extra


def serve_args(args) -> list[str]:
    """The demo's serve arguments: a small engine KV cache, eager mode."""
    usable = (args.engine_kv_blocks - 1) * args.block_size  # one block is vLLM's null block
    return ["--block-size", str(args.block_size),
            "--num-gpu-blocks-override", str(args.engine_kv_blocks),
            "--max-model-len", str(usable), "--max-num-batched-tokens", str(usable),
            "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0",
            *args.serve_arg]


def run_config(name: str, args, tokenizer, out_dir: Path, bar) -> ConfigRun:
    run = ConfigRun(name)
    log_path = out_dir / f"server-{name}.log"
    total = workload_size(args)
    start = time.monotonic()
    bar.set_description(f"{name}: starting server")
    done = [0]

    def on_result(_):
        done[0] += 1
        bar.update(1)

    port = free_port()
    started = False
    try:
        with vllm_server(args.model, transfer_config(name, args, out_dir),
                         config_serve_args(name, args),
                         env={"VLLM_LOGGING_LEVEL": "INFO", **args.cpu_env},
                         log_path=log_path, startup_timeout=args.startup_timeout,
                         port=port) as server:
            started = True
            run.binding = read_binding(log_path)
            server.stream_completion("warm up", max_tokens=2, timeout=120)
            before = {k: _metric(server, m) for k, m in METRICS.items()}
            bar.set_description(f"{name}: {args.workload}")
            load_before = os.getloadavg()[0]
            out = run_workload(args, server.url, args.model, tokenizer, on_result)
            run.load = (load_before, os.getloadavg()[0])
            after = {k: _metric(server, m) for k, m in METRICS.items()}
            run.counters = {k: after[k] - before[k] for k in METRICS}
            if args.lmbenchmark_dir:
                bar.set_description(f"{name}: LMBenchmark {lmbenchmark_time(args)} s")
                run.lmb_summary, run.lmb_error = run_lmbenchmark(args, server.url, name,
                                                                 out_dir)
        run.results = out.results
        run.summary = summarize(out.results, out.errors)
        run.summary["error_messages"] = out.errors[:20]
        planned = workload_size(args)
        run.status = ("ok" if len(out.results) == planned and not out.errors else
                      "incomplete" if out.results else "failed")
        if len(out.results) < planned and not out.errors:
            run.error = (f"{len(out.results)} of {planned} requests done within the workload "
                         f"deadline (--time {args.duration:.0f} s, --request-timeout "
                         f"{args.request_timeout:.0f} s)\nserver log:\n{log_errors(log_path)}")
        if out.errors:
            run.error = f"{len(out.errors)} request(s) failed; first: {out.errors[0]}\n" \
                        f"server log:\n{log_errors(log_path)}"
    except Exception as err:  # noqa: BLE001 - reported in the table, the next config runs
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not started:
            run.status = "did not start"
            cause = startup_error(log_path)
            if isinstance(err, TimeoutError):
                run.reason = (f"not ready after {args.startup_timeout:.0f} s "
                              f"(--startup-timeout)" + (f"; {cause}" if cause else ""))
            else:
                run.reason = cause or first
            run.error = f"{type(err).__name__}: {first}\nserver log: {log_path}"
        else:
            run.status = "failed"
            run.error = f"{type(err).__name__}: {first}\nserver log:\n{log_errors(log_path)}"
    # vllm_server has stopped the server and what it left; the next
    # configuration must not find this one's port or memory taken
    if not wait_port_free(port, timeout=30):
        run.error += (f"\nport {port} still in use 30 s after the server was stopped "
                      f"(a process of {log_path.name} is left: stop it before the next run)")
    if run.status == "ok" or (run.name == "lmcache" and run.results):
        run.log_errors = log_errors(log_path, limit=4, fallback=False)
        if name == "lmcache":  # LMCache logs its per-request lookup result
            hits = re.findall(r"LMCache hit tokens: (\d+)", log_path.read_text(errors="replace"))
            run.counters["lmcache_hit_tokens"] = sum(int(h) for h in hits)
    bar.update(total - done[0])
    run.wall_s = time.monotonic() - start
    run.binding = run.binding or read_binding(log_path)
    if run.results:
        write_csv(out_dir / f"{name}.csv", run.results)
    (out_dir / f"{name}.summary.json").write_text(json.dumps(
        {"status": run.status, "reason": run.reason, "error": run.error, "wall_s": run.wall_s,
         "cores": run.binding.describe() if run.binding else None,
         "counters": run.counters, **run.summary,
         "lmbenchmark": run.lmb_summary, "lmbenchmark_error": run.lmb_error}, indent=2))
    return run


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def unequal_cores(runs: list[ConfigRun]) -> str:
    """Why the runs that started a server are not comparable, or ''."""
    started = {r.name: r.binding for r in runs
               if (r.binding or r.results) and r.status != "did not start"}
    return check_equal(started)


def _gain(base: dict, s: dict) -> str:
    b, x = base.get("ttft_mean_s"), s.get("ttft_mean_s")
    return f"{b / x:.1f}x" if b and x and not math.isnan(b) and not math.isnan(x) else "-"


def report(runs: list[ConfigRun], args, command: str) -> str:
    env = " ".join(f"{k}={v}" for k, v in args.cpu_env.items())
    lines = [f"# kvbm-bench compare: {args.workload}", ""]
    problem = unequal_cores(runs)
    if problem:
        lines += [f"**NOT COMPARABLE: {problem}.** Set the same VLLM_CPU_OMP_THREADS_BIND "
                  "for every configuration and run again.", ""]
    lines += [f"Command: `{command}`", "",
              f"Model `{args.model}`; engine KV cache {args.engine_kv_blocks} blocks of "
              f"{args.block_size} tokens; serve args `{' '.join(serve_args(args))}`; every "
              f"server started with `{env}` on a {os.cpu_count()}-core machine.", ""]
    native = [r.name for r in runs if r.name == "vllm-offload" or r.name in NATIVE_CONNECTORS]
    if native:
        size = offload_bytes(args)
        lines += [f"vLLM's own offloading ({', '.join(native)}) gets {args.host_cache_size} of "
                  f"host RAM: `{' '.join(config_serve_args('vllm-offload', args)[-4:])}`, or "
                  f"`cpu_bytes_to_use: {size}` in the connector's kv_connector_extra_config.", ""]
    lines += ["| configuration | status | cores (server log) | requests | max in flight "
              "| TTFT mean ms | p50 | p90 | p99 | input tok/s | output tok/s "
              "| vLLM prefix hit rate | connector hit tokens |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cores = r.binding.describe() if r.binding else "-"
        s, c = r.summary, r.counters
        if r.status == "ok" or s:
            hit = (f"{c['prefix_hits'] / c['prefix_queries']:.0%}"
                   if c.get("prefix_queries") else "-")
            kvbm = (f"host {c['kvbm_host_tokens']:.0f}, disk {c['kvbm_disk_tokens']:.0f}"
                    if r.name.startswith("kvbm") else
                    f"{c['lmcache_hit_tokens']}" if "lmcache_hit_tokens" in c else "-")
            # a server that ran while its connector logged errors (LMCache's
            # manager not initialized on the CPU build): its figures are not the
            # connector's
            status = f"{r.status}, errors in its log (below)" if r.log_errors else r.status
            lines.append(f"| {LABELS[r.name]} | {status} | {cores} | {s['requests']}/"
                         f"{workload_size(args)} | {s.get('max_in_flight', '-')} | "
                         f"{_ms(s['ttft_mean_s'])} | {_ms(s['ttft_p50_s'])} | "
                         f"{_ms(s['ttft_p90_s'])} | {_ms(s['ttft_p99_s'])} | "
                         f"{s['input_tokens_per_s']:.0f} | {s['output_tokens_per_s']:.1f} | "
                         f"{hit} | {kvbm} |")
        else:
            status = (r.reason if r.status == "not supported" else
                      f"does not start: {r.reason}" if r.reason else "failed: see below")
            lines.append(f"| {LABELS[r.name]} | {status.replace('|', '/')} | {cores} | "
                         f"0/{workload_size(args)} | - | - | - | - | - "
                         f"| - | - | - | - |")
    rounds = sorted({q for r in runs for q in r.summary.get("ttft_mean_by_round_s", {})},
                    key=int)
    if rounds:  # noqa: SIM102
        lines += ["", "Mean TTFT (ms) per round (`question_id`):", "",
                  "| configuration | " + " | ".join(f"round {q}" for q in rounds) + " |",
                  "|---|" + "---:|" * len(rounds)]
        for r in runs:
            by = r.summary.get("ttft_mean_by_round_s", {})
            if by:
                lines.append(f"| {LABELS[r.name]} | "
                             + " | ".join(_ms(by.get(q, math.nan)) for q in rounds) + " |")
    if args.lmbenchmark_dir:
        base = next((r for r in runs if r.name == "vllm"), None)
        lines += ["", f"Both clients against the same servers: kvbm-bench's run above, then "
                  f"LMBenchmark's `{LMB_CLIENT}` (checkout `{args.lmbenchmark_dir}`) with the same "
                  f"users, rounds, QPS and lengths for {lmbenchmark_time(args)} s (its own "
                  "prompts, its own pacing: its first sessions start mid-conversation, and "
                  "requests unfinished at the deadline are dropped). Gain: vLLM's mean TTFT "
                  "over this configuration's, per client.", "",
                  "| configuration | kvbm-bench mean TTFT ms | gain | max in flight "
                  "| LMBenchmark mean TTFT ms | gain | requests | max in flight |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in runs:
            s, m = r.summary, r.lmb_summary
            lines.append(
                f"| {LABELS[r.name]} | {_ms(s.get('ttft_mean_s'))} | "
                f"{_gain(base.summary, s) if base else '-'} | {s.get('max_in_flight', '-')} | "
                f"{_ms(m.get('ttft_mean_s'))} | {_gain(base.lmb_summary, m) if base else '-'} | "
                f"{m.get('requests', '-')} | {m.get('max_in_flight', '-')} |")
        for r in runs:
            if r.lmb_error:
                lines += ["", f"LMBenchmark against **{LABELS[r.name]}**:", "", "```",
                          r.lmb_error.strip(), "```"]
    for r in runs:
        if r.status == "not supported":
            continue  # its row says why; nothing was started
        if r.reason:  # one line from the log, not its tracebacks
            lines += ["", f"**{LABELS[r.name]}** did not start (after {r.wall_s:.0f} s); the "
                      "cause in its server log:", "", "```", r.reason, "```", "",
                      "; ".join(ln.split("; errors in ")[0]
                                for ln in r.error.strip().splitlines()) + "."]
        elif r.error:
            lines += ["", f"**{LABELS[r.name]}** ({r.status}, after {r.wall_s:.0f} s):", "",
                      "```", r.error.strip(), "```"]
    noisy = [r for r in runs if r.log_errors and not r.error]
    for r in noisy:
        lines += ["", f"Error lines in the server log of **{LABELS[r.name]}** "
                  "(the server ran; distinct lines, last ones):", "",
                  "```", r.log_errors.strip(), "```"]
    lines += ["", "Wall time per configuration (server start, warm-up, workload, stop): "
              + ", ".join(f"{r.name} {r.wall_s:.0f} s" for r in runs) + ". "
              "1-minute load average at the start and end of kvbm-bench's workload (other "
              "work on the machine shows here): "
              + ", ".join(f"{r.name} {r.load[0]:.1f} / {r.load[1]:.1f}" for r in runs if r.load)
              + "."]
    return "\n".join(lines) + "\n"


def plots(runs: list[ConfigRun], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.results]
    if not ok:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80)
    data = [[x.ttft * 1000 for x in r.results] for r in ok]
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(ok) + 1), [LABELS[r.name].replace("vLLM + ", "")
                                          for r in ok], fontsize=8)
    for i, d in enumerate(data, start=1):
        ax.scatter([i + (j % 5 - 2) * 0.04 for j in range(len(d))], d, s=8, alpha=0.6)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("TTFT distribution per configuration", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "ttft_distribution.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80)
    for r in ok:
        by = sorted((int(k), v * 1000) for k, v in r.summary["ttft_mean_by_round_s"].items())
        ax.plot([k for k, _ in by], [v for _, v in by], marker="o", label=LABELS[r.name])
    ax.set_xlabel("round (question_id)")
    ax.set_yscale("log")
    ax.set_ylabel("mean TTFT (ms, log scale)")
    ax.set_title("TTFT per round", fontsize=10)
    ax.set_xticks(sorted({int(k) for r in ok for k in r.summary["ttft_mean_by_round_s"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "ttft_per_round.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="kvbm-bench compare", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the local model)")
    p.add_argument("--workload", choices=["multi-round", "doc-qa"], default="multi-round")
    p.add_argument("--configs", nargs="+", default=ALL_CONFIGS, choices=ALL_CONFIGS)
    p.add_argument("--out-dir", default=None, help="default: bench-results/compare-<time>")
    p.add_argument("--engine-kv-blocks", type=int, default=48,
                   help="engine KV cache in blocks: room for about three requests of the "
                   "default workload at once, not for every user's history")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--host-cache-size", default="1GiB",
                   help="KVBM's host tier (kvbm-host) and vLLM's offloading buffer "
                   "(vllm-offload, offloading-connector, simple-cpu-offload)")
    p.add_argument("--host-disk-host-blocks", type=int, default=24,
                   help="host tier blocks for kvbm-host-disk (smaller than the working set)")
    p.add_argument("--disk-cache-size", default="2GiB")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--run-unsupported", action="store_true",
                   help="start configurations this platform does not support (marked "
                   "'not supported' otherwise) and report how they fail")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for vllm serve (repeatable)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration, unless "
                   "VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU is set (then "
                   "those, for every configuration); vLLM itself reserves one more core for "
                   "an engine with a kv_transfer_config")
    p.add_argument("--lmbenchmark-dir", default=os.environ.get("LMBENCHMARK_DIR") or None,
                   help="a checkout of LMCache/LMBenchmark: also run its multi-round QA "
                   "client against each configuration (default: $LMBENCHMARK_DIR)")
    p.add_argument("--lmbenchmark-python",
                   default=os.environ.get("LMBENCHMARK_PYTHON") or sys.executable,
                   help="python for LMBenchmark's client, with openai and pandas "
                   "(default: $LMBENCHMARK_PYTHON, else this python)")
    p.add_argument("--lmbenchmark-time", type=int, default=0,
                   help="seconds LMBenchmark's client runs (default: requests / qps)")
    # the multi-round and doc-qa options, both accepted; the chosen workload's are used
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=["multi-round", "doc-qa"], default="multi-round")
    add_workload_args(p, pre.parse_known_args(argv)[0].workload)
    args = p.parse_args(argv)
    args.cpu_env = fair_cpu_env(reserved=args.reserved_cpus)
    if args.lmbenchmark_dir:
        if args.workload != "multi-round":
            p.error("--lmbenchmark-dir runs LMBenchmark's multi-round QA: use --workload "
                    "multi-round")
        problem = lmbenchmark_problem(args)
        if problem:
            print(f"kvbm-bench compare: {problem}", file=sys.stderr)
            return 2
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    out_dir = Path(args.out_dir or f"bench-results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    from vllm_kvbm.bench.client import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    command = "kvbm-bench compare " + " ".join(argv)
    runs = []
    t0 = time.monotonic()
    with tqdm(total=workload_size(args) * len(args.configs), unit="req") as bar:
        for name in args.configs:
            why = "" if args.run_unsupported else unsupported_here(name)
            if why:
                runs.append(ConfigRun(name, status="not supported", reason=why))
                bar.update(workload_size(args))
                bar.write(f"{name}: {why} (--run-unsupported starts it anyway)")
                continue
            runs.append(run_config(name, args, tokenizer, out_dir, bar))
            r = runs[-1]
            msg = (format_summary(r.summary) if r.summary else
                   r.reason or r.error.splitlines()[0])
            cores = r.binding.describe() if r.binding else "cores unknown"
            bar.write(f"{name}: {r.status} in {r.wall_s:.0f} s on {cores}; {msg}")
            if r.lmb_summary or r.lmb_error:
                bar.write(f"{name}: LMBenchmark: " + (format_summary(r.lmb_summary)
                                                      if r.lmb_summary else r.lmb_error))
    text = report(runs, args, command.strip())
    text += f"\nTotal wall time: {time.monotonic() - t0:.0f} s.\n"
    (out_dir / "report.md").write_text(text)
    for path in plots(runs, out_dir):
        text += f"\n![{path.stem}]({path.name})\n"
    (out_dir / "report.md").write_text(text)
    print(text)
    print(f"results in {out_dir}")
    if unequal_cores(runs):
        print(f"kvbm-bench compare: NOT COMPARABLE: {unequal_cores(runs)}", file=sys.stderr)
        return 3
    if all(r.status == "not supported" for r in runs):
        print("kvbm-bench compare: no configuration asked for runs on this platform",
              file=sys.stderr)
        return 2
    return 0 if any(r.status == "ok" for r in runs) else 1  # a failed config is reported


if __name__ == "__main__":
    sys.exit(main())
