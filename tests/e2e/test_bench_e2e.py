"""The benchmark client (vllm_kvbm.bench) against a real `vllm serve` with the
connector: LMBenchmark's multi-round QA and long-document QA, bench_frozen_remote's
token stream, `kvbm-bench compare` against a server given by URL and against one
it starts, and the cores read from a real engine's processes
(tests/unit/test_bench.py: the rest)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import sys
from pathlib import Path

import pytest

from helpers.engines import MODEL_DIR
from vllm_kvbm.bench.__main__ import main as kvbm_bench
from vllm_kvbm.bench.client import (
    ARRIVAL_COLUMNS,
    COLUMNS,
    read_csv,
    run_doc_qa,
    run_multi_round,
    summarize,
    write_csv,
)
from vllm_kvbm.bench.cores import process_binding
from vllm_kvbm.bench.workloads import MultiRoundQA, TextSource, long_doc_qa
from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(300)

SERVE_ARGS = [
    "--enforce-eager",
    "--block-size",
    "128",
    "--max-model-len",
    "2048",
    "--gpu-memory-utilization",
    "0.25",
    "--num-gpu-blocks-override",
    "32",
]


def _check(path, results, expected_rows, summary):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS + ARRIVAL_COLUMNS
        rows = list(reader)
    assert len(rows) == expected_rows == len(results)
    # queued: sent while another request of the run had not finished
    for row in rows:
        others = sum(
            float(o["launch_time"]) <= float(row["launch_time"]) < float(o["finish_time"])
            for o in rows
            if o is not row
        )
        assert int(row["others_in_flight"]) == others, row
        assert row["arrival"] == ("queued" if others else "alone"), row
    for r in read_csv(path):
        total = r.finish_time - r.launch_time
        assert 0 < r.ttft < total, r
        assert r.generation_time == pytest.approx(total - r.ttft, abs=1e-3)
        assert r.prompt_tokens > 0 and r.generation_tokens > 0
    rows = read_csv(path)
    ttfts = sorted(r.ttft for r in rows)
    span = max(r.finish_time for r in rows) - min(r.launch_time for r in rows)
    again = summarize(rows)
    assert summary["requests"] == len(rows)
    assert summary["ttft_mean_s"] == pytest.approx(sum(ttfts) / len(ttfts), rel=1e-6)
    assert (
        ttfts[0]
        <= summary["ttft_p50_s"]
        <= summary["ttft_p90_s"]
        <= summary["ttft_p99_s"]
        <= ttfts[-1]
    )
    assert summary["input_tokens_per_s"] == pytest.approx(
        sum(r.prompt_tokens for r in rows) / span, rel=1e-6
    )
    assert summary["output_tokens_per_s"] == pytest.approx(
        sum(r.generation_tokens for r in rows) / span, rel=1e-6
    )
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "duration_s"):
        assert summary[key] == pytest.approx(again[key], rel=1e-6)


async def _frozen_remote_stream(server):
    import importlib.util
    import time

    from vllm_kvbm.tools.completions import async_client

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frozen_remote.py"
    spec = importlib.util.spec_from_file_location("kvbm_bench_frozen_remote", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = bench.Stream(time.perf_counter())
    async with async_client(server.url) as client:
        await bench.stream(client, server.model, list(range(100, 140)), 6, out, 60)
    return out


# kvbm-bench's workload options for a small run
SMALL = [
    "--num-users",
    "2",
    "--num-rounds",
    "2",
    "--qps",
    "8",
    "--shared-system-prompt",
    "200",
    "--user-history-prompt",
    "100",
    "--answer-len",
    "4",
    "--request-timeout",
    "120",
]


def test_bench_client_against_vllm_serve(model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer
    from vllm.utils.cpu_resource_utils import parse_id_list

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    # the cores vLLM is told to bind to (a test worker's own core, else the first)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or str(min(os.sched_getaffinity(0)))
    with vllm_server(
        str(MODEL_DIR),
        kvbm_transfer_config(host_cache_size="256MiB"),
        SERVE_ARGS,
        startup_timeout=240,
        env={"VLLM_CPU_OMP_THREADS_BIND": bind},
    ) as server:
        wl = MultiRoundQA(
            TextSource(tok),
            num_users=2,
            num_rounds=2,
            system_prompt_tokens=300,
            user_history_tokens=100,
            answer_tokens=4,
        )
        # LMBenchmark's pacing at 40 QPS: rounds 50 ms apart, user 1 joins 25 ms after
        # user 0, while user 0's first prefill is still running
        out = asyncio.run(
            run_multi_round(server.url, server.model, wl, qps=40, duration=60, request_timeout=60)
        )
        docs = long_doc_qa(
            TextSource(tok, seed=1),
            num_documents=2,
            document_tokens=300,
            repeat_count=1,
            hit_ratio=0.5,
        )
        doc_out = asyncio.run(
            run_doc_qa(
                server.url,
                server.model,
                docs,
                answer_tokens=3,
                qps=4,
                duration=60,
                request_timeout=60,
            )
        )
        itl_stream = asyncio.run(_frozen_remote_stream(server))
        # read from the running engine's processes, after KVBM's I/O threads
        # (which span every core) have stored pages
        binding = process_binding(server.process.pid)
        # compare against servers it does not start: this one, twice
        out_dir = tmp_path / "by-url"
        rc = kvbm_bench(
            [
                "compare",
                "--url",
                f"a={server.url}",
                "--url",
                f"b={server.url}/v1",
                *SMALL,
                "--out-dir",
                str(out_dir),
            ]
        )
        compared = capsys.readouterr()
        # the command a user runs against it: the model it serves, found by asking it
        docs_csv = tmp_path / "docs.csv"
        doc_rc = kvbm_bench(
            [
                "doc-qa",
                "--base-url",
                server.url,
                "--num-documents",
                "2",
                "--document-length",
                "200",
                "--repeat-count",
                "1",
                "--answer-len",
                "2",
                "--qps",
                "8",
                "--output",
                str(docs_csv),
            ]
        )
        doc_printed = capsys.readouterr()
    assert doc_rc == 0, doc_printed.err[-3000:]
    assert len(read_csv(docs_csv)) == 4 and "requests 4 (errors 0)" in doc_printed.out
    assert json.loads(docs_csv.with_suffix(".summary.json").read_text())["requests"] == 4
    assert binding is not None and binding.cores == (tuple(sorted(parse_id_list(bind))),), (
        bind,
        binding,
    )
    assert rc == 0, compared.err[-3000:]
    report = (out_dir / "report.md").read_text()
    cores = binding.describe()
    # TTFT per round and arrival: 2 requests a round, a's and b's side by side
    assert "| round | arrival | a requests | mean | p50 | p90 | b requests |" in report, report
    for key in ("round 0", "round 1"):
        assert re.search(
            rf"^\| {key} \| all \| 2 \| \d+ \| \d+ \| \d+ \| 2 \| "
            r"\d+ \| \d+ \| \d+ \| \d+\.\dx \|$",
            report,
            re.M,
        ), report
    assert re.search(r"^\| every round \| all \| 4 \| ", report, re.M), report
    for name in ("a", "b"):
        assert f"| {name} | ok | {cores} | 4/4 |" in report, report
        summary = json.loads((out_dir / f"{name}.summary.json").read_text())
        assert summary["url"] == server.url and summary["requests"] == 4
        split = summary["ttft_by_round_arrival"]
        assert list(split) == ["0", "1", "all"]
        for by in split.values():
            assert by["alone"]["requests"] + by["queued"]["requests"] == by["all"]["requests"]
        assert split["all"]["all"]["ttft_mean_s"] == pytest.approx(summary["ttft_mean_s"])
        assert summary["counters"]["prefix_queries"] > 0
        assert "host" in summary["counters"]["kvbm_tokens"]  # a server with KVBM
    assert f"servers kvbm-bench did not start: a {server.url}, b {server.url}" in report
    assert not list(out_dir.glob("server-*.log"))  # nothing was started
    assert {p.name for p in out_dir.glob("*.png")} == {
        "ttft_per_round.png",
        "ttft_by_arrival.png",
        "hit_tokens.png",
        "ttft_distribution.png",
    }
    # bench_frozen_remote's ITL reads the real stream: each generated token once,
    # the final chunk (no new token), usage and [DONE] not counted as tokens
    assert itl_stream.done and sum(itl_stream.tokens) == 6, itl_stream
    assert len(itl_stream.stamps) == len(itl_stream.tokens)
    assert itl_stream.stamps == sorted(itl_stream.stamps)
    assert not out.errors and not doc_out.errors, (out.errors, doc_out.errors)
    # a user's round r+1 prompt extends round r's prompt and its answer
    by_user = {}
    for r in out.results:
        by_user.setdefault(r.user_id, []).append(r)
    assert sorted(by_user) == [0, 1]
    for rs in by_user.values():
        assert [r.question_id for r in rs] == [0, 1]
        assert rs[1].prompt_tokens > rs[0].prompt_tokens + 4
        assert rs[1].launch_time >= rs[0].finish_time
        assert rs[1].launch_time >= rs[0].launch_time + 0.05
    # user 1 joined later, not at once (25 ms planned; user 0's launch may itself run late)
    assert by_user[1][0].launch_time >= by_user[0][0].launch_time + 0.01
    assert summarize(out.results)["max_in_flight"] == 2
    for name, res, n in (("mr", out, 4), ("doc", doc_out, 4)):
        path = tmp_path / f"{name}.csv"
        write_csv(path, res.results)
        _check(path, res.results, n, summarize(res.results, res.errors))


def test_compare_starts_a_server_with_the_users_serve_args(model_dir, tmp_path, capsys):
    """`kvbm-bench compare --configs`: the progress line names the server while
    it starts, arguments after -- replace the CPU defaults in the server
    vLLM runs, and the cores are read from it."""
    out_dir = tmp_path / "started"
    rc = kvbm_bench(
        [
            "compare",
            "--configs",
            "kvbm-host",
            "--model",
            str(MODEL_DIR),
            "--engine-kv-blocks",
            "24",
            "--startup-timeout",
            "240",
            *SMALL,
            "--out-dir",
            str(out_dir),
            "--",
            "--max-model-len",
            "1024",
            # vLLM CPU refuses to start when less than this share of the RAM is
            # free, and the suite's other engines hold some (0.3 by default)
            "--gpu-memory-utilization",
            "0.2",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "starting server kvbm-host (" in err  # the progress line, with the seconds waited
    report = (out_dir / "report.md").read_text()
    assert "--max-model-len 1024" in report and "--max-model-len 2944" not in report
    log = (out_dir / "server-kvbm-host.log").read_text()
    assert "max_seq_len=1024" in log  # what vLLM ran with
    assert "| vLLM + KVBM (host) | ok | cores " in report, report
    assert json.loads((out_dir / "kvbm-host.summary.json").read_text())["cores"]
