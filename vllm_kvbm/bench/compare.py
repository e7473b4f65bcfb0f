"""Runs one workload against several server configurations, one after another.

    kvbm-bench compare                       # the local model, all configurations
    kvbm-bench compare --url plain=http://h1:8000 --url kvbm=http://h2:8000

Started servers (``--configs``): for each configuration, start ``vllm serve``
(same model, same serve arguments, ``serve_args.py``; the same CPU binding
environment), send a warm-up request, run the workload, read the server's
counters, then, with ``--lmbenchmark-dir`` (or LMBENCHMARK_DIR), run the real
LMBenchmark client (``synthetic-multi-round-qa/multi-round-qa.py``) against the
same server with the same sizes, and stop the server. While a server starts,
the progress line says so, with the seconds waited and its log's last line.
The cores each server's OpenMP threads ran on are read from its processes
(``cores.py``): a comparison whose configurations ran on different cores is
marked as not comparable and exits 3. vLLM's own CPU offloading runs as three
configurations: ``--kv-offloading-size`` (``--kv-offloading-backend native``:
vLLM picks the OffloadingConnector, or the SimpleCPUOffloadConnector with
VLLM_USE_SIMPLE_KV_OFFLOAD=1) and each of those two connectors named in
``--kv-transfer-config``; all get ``--host-cache-size`` of host RAM, as KVBM's
host tier does. A configuration that cannot run on this platform (vLLM's
offloading and LMCache's connector on vLLM's CPU build) is marked "not
supported" with the reason, not started (``--run-unsupported`` starts it
anyway); one that fails to start is reported with the root-cause line of its
server log instead of being left out, and the next one runs.

Servers the user runs (``--url NAME=URL``): nothing is started; each gets the
same warm-up, workload and counters, and the cores of a server on this machine
are read from the process listening on its port. Writes, under ``--out-dir``:
per-configuration CSV and summary JSON, the logs of started servers,
``report.md`` (``report.py``) and PNG plots (``plots.py``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvbm.bench.cli import CONFIGS as ALL_CONFIGS
from vllm_kvbm.bench.client import (
    Unusable,
    format_summary,
    pick_model,
    run_workload,
    summarize,
    tokenizer_for,
    workload_size,
    write_csv,
)
from vllm_kvbm.bench.cores import Binding, check_equal, fair_cpu_env, listening_pid, process_binding
from vllm_kvbm.bench.lmbenchmark import lmbenchmark_problem, lmbenchmark_time, run_lmbenchmark
from vllm_kvbm.bench.platforms import unsupported_here
from vllm_kvbm.bench.serve_args import serve_args
from vllm_kvbm.bench.server_logs import log_errors, startup_error
from vllm_kvbm.config import parse_size
from vllm_kvbm.tools.server import (
    Server,
    free_port,
    kvbm_transfer_config,
    vllm_server,
    wait_port_free,
)

LMCACHE_CONFIG = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
# vLLM's own CPU offloading: the serve flag and the two connectors it can pick
NATIVE_CONNECTORS = {
    "offloading-connector": "OffloadingConnector",
    "simple-cpu-offload": "SimpleCPUOffloadConnector",
}
LABELS = {
    "vllm": "vLLM prefix caching",
    "kvbm-host": "vLLM + KVBM (host)",
    "kvbm-host-disk": "vLLM + KVBM (host+disk)",
    "vllm-offload": "vLLM --kv-offloading-size (native)",
    "offloading-connector": "vLLM + OffloadingConnector",
    "simple-cpu-offload": "vLLM + SimpleCPUOffloadConnector",
    "lmcache": "vLLM + LMCacheConnectorV1",
}
# KVBM's tiers in the order the report and the plots name them
TIERS = ("host", "pool", "disk", "peer", "remote")


@dataclass
class ConfigRun:
    name: str
    status: str = "not run"  # ok | incomplete | failed | did not start | not supported
    error: str = ""
    reason: str = ""  # one line: why a server did not start
    log_errors: str = ""  # distinct error lines of a server that did run
    summary: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    wall_s: float = 0.0
    binding: Binding | None = None  # the cores its OpenMP threads ran on (its processes)
    lmb_summary: dict = field(default_factory=dict)  # the real LMBenchmark client's run
    lmb_error: str = ""
    load: tuple = ()  # 1-minute load average at the workload's start and end
    url: str = ""  # a server the user runs (--url); "" when started here

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name)


def transfer_config(name: str, args, out_dir: Path) -> dict | None:
    if name == "vllm":
        return None
    if name == "kvbm-host":
        return kvbm_transfer_config(host_cache_size=args.host_cache_size)
    if name == "kvbm-host-disk":
        disk = out_dir / "disk-tier"
        disk.mkdir(parents=True, exist_ok=True)
        return kvbm_transfer_config(
            host_cache_blocks=args.host_disk_host_blocks,
            disk_cache_dir=str(disk.resolve()),
            disk_cache_size=args.disk_cache_size,
        )
    if name == "lmcache":
        return dict(LMCACHE_CONFIG)
    if name == "vllm-offload":
        return None  # the serve flags below configure it
    if name in NATIVE_CONNECTORS:
        return {
            "kv_connector": NATIVE_CONNECTORS[name],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": offload_bytes(args)},
        }
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
        extra = [
            "--kv-offloading-size",
            f"{offload_bytes(args) / (1 << 30):g}",
            "--kv-offloading-backend",
            "native",
        ]
    return serve_args(args) + extra


def read_counters(text: str) -> dict:
    """vLLM's prefix cache counters and, on a server with KVBM, the tokens
    each of its tiers matched (``kvbm_tokens``), from a /metrics text."""
    out = {
        "prefix_hits": Server.metric_total(text, "vllm:prefix_cache_hits_total"),
        "prefix_queries": Server.metric_total(text, "vllm:prefix_cache_queries_total"),
    }
    if "kvbm_matched_tokens_total" in text:
        from prometheus_client.parser import text_string_to_metric_families

        tiers = {
            s.labels.get("tier")
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "kvbm_matched_tokens_total"
        }
        out["kvbm_tokens"] = {
            t: Server.metric_total(text, "kvbm_matched_tokens_total", tier=t)
            for t in sorted(tiers - {None}, key=_tier_order)
        }
    return out


def _tier_order(tier: str) -> tuple:
    return (TIERS.index(tier) if tier in TIERS else len(TIERS), tier)


def counters_of(url: str) -> dict | None:
    """The counters of the server at ``url``, None when its /metrics does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            return read_counters(resp.read().decode())
    except OSError:
        return None


def delta(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {}
    out = {k: after[k] - before.get(k, 0.0) for k in ("prefix_hits", "prefix_queries")}
    if "kvbm_tokens" in after:
        was = before.get("kvbm_tokens", {})
        out["kvbm_tokens"] = {t: n - was.get(t, 0.0) for t, n in after["kvbm_tokens"].items()}
    return out


def _measure(run: ConfigRun, args, url: str, model: str, tokenizer, bar, on_result) -> None:
    """The warm-up, the workload, the counters around it and LMBenchmark's
    client, against a running server."""
    from vllm_kvbm.tools.completions import stream_sync

    stream_sync(url, model, "warm up", max_tokens=2, timeout=120)
    before = counters_of(url)
    bar.set_description_str(f"{run.name}: {args.workload}")
    load_before = os.getloadavg()[0]
    out = run_workload(args, url, model, tokenizer, on_result)
    run.load = (load_before, os.getloadavg()[0])
    run.counters = delta(before, counters_of(url))
    run.results = out.results
    run.summary = summarize(out.results, out.errors)
    run.summary["error_messages"] = out.errors[:20]
    if args.lmbenchmark_dir:
        bar.set_description_str(f"{run.name}: LMBenchmark {lmbenchmark_time(args)} s")
        run.lmb_summary, run.lmb_error = run_lmbenchmark(args, url, run.name, args.out_dir_path)
    planned = workload_size(args)
    run.status = (
        "ok"
        if len(out.results) == planned and not out.errors
        else "incomplete"
        if out.results
        else "failed"
    )
    if len(out.results) < planned and not out.errors:
        run.error = (
            f"{len(out.results)} of {planned} requests done within the workload "
            f"deadline (--time {args.duration:.0f} s, --request-timeout "
            f"{args.request_timeout:.0f} s)"
        )
    if out.errors:
        run.error = f"{len(out.errors)} request(s) failed; first: {out.errors[0]}"


def run_config(name: str, args, tokenizer, out_dir: Path, bar) -> ConfigRun:
    """One configuration on a server started here."""
    run = ConfigRun(name)
    log_path = out_dir / f"server-{name}.log"
    start = time.monotonic()
    done = [0]

    def on_result(_):
        done[0] += 1
        bar.update(1)

    def starting(seconds: float, line: str) -> None:
        bar.set_description_str(f"starting server {name} ({seconds:.0f} s): {line}")

    port = free_port()
    started = False
    try:
        with vllm_server(
            args.model,
            transfer_config(name, args, out_dir),
            config_serve_args(name, args),
            env={"VLLM_LOGGING_LEVEL": "INFO", **args.cpu_env},
            log_path=log_path,
            startup_timeout=args.startup_timeout,
            port=port,
            on_wait=starting,
        ) as server:
            started = True
            run.binding = process_binding(server.process.pid)
            _measure(run, args, server.url, args.model, tokenizer, bar, on_result)
        if run.error:
            run.error += f"\nserver log:\n{log_errors(log_path)}"
    except Exception as err:  # noqa: BLE001 - reported in the table, the next config runs
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not started:
            run.status = "did not start"
            cause = startup_error(log_path)
            if isinstance(err, TimeoutError):
                run.reason = f"not ready after {args.startup_timeout:.0f} s (--startup-timeout)" + (
                    f"; {cause}" if cause else ""
                )
            else:
                run.reason = cause or first
            run.error = f"{type(err).__name__}: {first}\nserver log: {log_path}"
        else:
            run.status = "failed"
            run.error = f"{type(err).__name__}: {first}\nserver log:\n{log_errors(log_path)}"
    # vllm_server has stopped the server and what it left; the next
    # configuration must not find this one's port or memory taken
    if not wait_port_free(port, timeout=30):
        run.error += (
            f"\nport {port} still in use 30 s after the server was stopped "
            f"(a process of {log_path.name} is left: stop it before the next run)"
        )
    if run.status == "ok" or (run.name == "lmcache" and run.results):
        run.log_errors = log_errors(log_path, limit=4, fallback=False)
        if name == "lmcache":  # LMCache logs its per-request lookup result
            hits = re.findall(r"LMCache hit tokens: (\d+)", log_path.read_text(errors="replace"))
            run.counters["lmcache_hit_tokens"] = sum(int(h) for h in hits)
    bar.update(workload_size(args) - done[0])
    run.wall_s = time.monotonic() - start
    return run


def run_url(name: str, url: str, args, tokenizer, bar) -> ConfigRun:
    """One server the user runs: nothing started or stopped."""
    run = ConfigRun(name, url=url)
    start = time.monotonic()
    done = [0]

    def on_result(_):
        done[0] += 1
        bar.update(1)

    try:
        model, _ = pick_model(url, args.model, f"--url {name}")
        pid = listening_pid(url)
        run.binding = process_binding(pid) if pid else None
        _measure(run, args, url, model, tokenizer, bar, on_result)
    except Exception as err:  # noqa: BLE001 - reported in the table, the next server runs
        run.status = "failed"
        run.error = f"{type(err).__name__}: {err}" if not isinstance(err, Unusable) else str(err)
    bar.update(workload_size(args) - done[0])
    run.wall_s = time.monotonic() - start
    return run


def write_run(run: ConfigRun, out_dir: Path) -> None:
    if run.results:
        write_csv(out_dir / f"{run.name}.csv", run.results)
    (out_dir / f"{run.name}.summary.json").write_text(
        json.dumps(
            {
                "status": run.status,
                "url": run.url or None,
                "reason": run.reason,
                "error": run.error,
                "wall_s": run.wall_s,
                "cores": run.binding.describe() if run.binding else None,
                "counters": run.counters,
                **run.summary,
                "lmbenchmark": run.lmb_summary,
                "lmbenchmark_error": run.lmb_error,
            },
            indent=2,
        )
    )


def unequal_cores(runs: list[ConfigRun]) -> str:
    """Why the runs that reached a server are not comparable, or ''. A
    server given by URL whose cores could not be read (one on another
    machine) is left out of the check."""
    started = {
        r.name: r.binding
        for r in runs
        if (r.binding or r.results) and r.status not in ("did not start", "failed")
    }
    return check_equal(started, unknown_ok=any(r.url for r in runs))


def _prepare(args) -> tuple[object, Path]:
    """The model, its tokenizer and the results directory; Unusable when the
    model or a server cannot be used."""
    if args.url:
        model, root = pick_model(args.url[0][1], args.model, f"--url {args.url[0][0]}")
        args.model = args.model or model
    else:
        if args.model is None:
            from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

            args.model = str(build(DEFAULT_DIR))
        root = args.model
    tokenizer = tokenizer_for(args.tokenizer, args.model, root)
    out_dir = Path(args.out_dir or f"bench-results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return tokenizer, out_dir


def main(args, argv: list[str]) -> int:
    """compare, with the arguments cli.py parsed and checked."""
    from tqdm import tqdm

    from vllm_kvbm.bench.plots import plots
    from vllm_kvbm.bench.report import report

    args.cpu_env = fair_cpu_env(reserved=args.reserved_cpus)
    if args.lmbenchmark_dir:
        problem = lmbenchmark_problem(args)
        if problem:
            print(f"kvbm-bench compare: {problem} (--lmbenchmark-dir)", file=sys.stderr)
            return 2
    try:
        tokenizer, out_dir = _prepare(args)
    except Unusable as err:
        print(f"kvbm-bench compare: {err}", file=sys.stderr)
        return err.code
    args.out_dir_path = out_dir
    names = [n for n, _ in args.url] if args.url else args.configs
    runs: list[ConfigRun] = []
    t0 = time.monotonic()
    with tqdm(total=workload_size(args) * len(names), unit="req") as bar:
        for name, url in args.url or [(n, "") for n in args.configs]:
            why = "" if url or args.run_unsupported else unsupported_here(name)
            if why:
                runs.append(ConfigRun(name, status="not supported", reason=why))
                bar.update(workload_size(args))
                bar.write(f"{name}: {why} (--run-unsupported starts it anyway)")
                write_run(runs[-1], out_dir)
                continue
            runs.append(
                run_url(name, url, args, tokenizer, bar)
                if url
                else run_config(name, args, tokenizer, out_dir, bar)
            )
            r = runs[-1]
            write_run(r, out_dir)
            msg = format_summary(r.summary) if r.summary else r.reason or r.error.splitlines()[0]
            cores = r.binding.describe() if r.binding else "cores not read"
            bar.write(f"{name}: {r.status} in {r.wall_s:.0f} s on {cores}; {msg}")
            if r.lmb_summary or r.lmb_error:
                bar.write(
                    f"{name}: LMBenchmark: "
                    + (format_summary(r.lmb_summary) if r.lmb_summary else r.lmb_error)
                )
    text = report(runs, args, ("kvbm-bench compare " + " ".join(argv)).strip())
    text += f"\nTotal wall time: {time.monotonic() - t0:.0f} s.\n"
    for path in plots(runs, out_dir, args.workload):
        text += f"\n![{path.stem}]({path.name})\n"
    (out_dir / "report.md").write_text(text)
    print(text)
    print(f"results in {out_dir}")
    ran = [r for r in runs if r.status != "not supported"]
    if not ran:
        print(
            "kvbm-bench compare: no configuration asked for runs on this platform "
            "(--run-unsupported starts them anyway)",
            file=sys.stderr,
        )
        return 2
    failed = [r.name for r in ran if r.status != "ok"]
    if failed:
        print(
            f"kvbm-bench compare: {', '.join(failed)} did not run every request (the report "
            "says why)",
            file=sys.stderr,
        )
        return 1
    if unequal_cores(runs):
        print(f"kvbm-bench compare: NOT COMPARABLE: {unequal_cores(runs)}", file=sys.stderr)
        return 3
    return 0
