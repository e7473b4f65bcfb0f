"""kvbm-bench's arrival classes (a request sent alone or while another ran) and
the TTFT per round and arrival that the summary, the report and the plots give,
on request records laid out by hand (tests/e2e/test_bench_e2e.py: the same
from a real server)."""

from __future__ import annotations

import argparse
import csv
import json
import re

import pytest

from vllm_kvbm.bench.arrivals import arrival_classes, others_in_flight, ttft_by_round_arrival
from vllm_kvbm.bench.client import ARRIVAL_COLUMNS, COLUMNS, Result, summarize, write_csv
from vllm_kvbm.bench.compare import ConfigRun
from vllm_kvbm.bench.report import report

pytestmark = pytest.mark.timeout(120)


def req(user: int, rnd: int, launch: float, finish: float, ttft: float) -> Result:
    return Result(1000, 8, ttft, finish - launch - ttft, user, rnd, launch, finish)


def test_a_request_sent_while_another_runs_is_queued():
    rows = [
        req(0, 0, 10.0, 12.0, 0.5),  # alone: nothing else in flight
        req(1, 0, 11.0, 13.0, 0.9),  # queued behind user 0 (sent 10.0, ends 12.0)
        req(2, 0, 11.5, 12.5, 1.0),  # queued behind both
        req(0, 1, 13.0, 14.0, 0.2),  # user 1 finishes at this very instant: alone
        req(1, 1, 20.0, 21.0, 0.1),  # alone, long after the rest
        req(2, 1, 20.0, 20.5, 0.3),
    ]  # sent at the same instant as user 1: both queued
    assert others_in_flight(rows) == [0, 1, 2, 0, 1, 1]
    assert arrival_classes(rows) == ["alone", "queued", "queued", "alone", "queued", "queued"]
    # the order of the records does not matter
    assert others_in_flight(rows[::-1]) == [1, 1, 0, 2, 1, 0]
    # against the definition, pair by pair
    for r, n in zip(rows, others_in_flight(rows)):
        assert n == sum(o.launch_time <= r.launch_time < o.finish_time for o in rows if o is not r)


def test_ttft_per_round_and_arrival_comes_from_the_right_requests():
    rows = [
        req(0, 0, 0.0, 2.0, 0.4),
        req(1, 0, 1.0, 3.0, 1.0),  # round 0: alone, queued
        req(0, 1, 5.0, 6.0, 0.2),
        req(1, 1, 7.0, 8.0, 0.1),  # round 1: both alone
        req(2, 1, 7.5, 9.0, 0.6),
    ]  # round 1: queued
    split = ttft_by_round_arrival(rows)
    assert list(split) == ["0", "1", "all"]
    assert split["0"]["alone"] == {
        "requests": 1,
        "ttft_mean_s": 0.4,
        "ttft_p50_s": 0.4,
        "ttft_p90_s": pytest.approx(0.4),
    }
    assert split["0"]["queued"]["ttft_mean_s"] == pytest.approx(1.0)
    assert split["1"]["alone"]["requests"] == 2
    assert split["1"]["alone"]["ttft_mean_s"] == pytest.approx(0.15)
    assert split["1"]["alone"]["ttft_p90_s"] == pytest.approx(0.19)  # numpy's interpolation
    assert split["1"]["queued"]["ttft_mean_s"] == pytest.approx(0.6)
    assert split["1"]["all"]["ttft_mean_s"] == pytest.approx(0.3)
    assert split["all"]["alone"]["ttft_mean_s"] == pytest.approx((0.4 + 0.2 + 0.1) / 3)
    assert split["all"]["queued"]["ttft_mean_s"] == pytest.approx(0.8)
    assert split["all"]["all"]["requests"] == 5
    # a class without requests has no figures, and stays valid JSON
    alone_only = ttft_by_round_arrival([req(0, 0, 0.0, 1.0, 0.3)])
    assert alone_only["0"]["queued"] == {
        "requests": 0,
        "ttft_mean_s": None,
        "ttft_p50_s": None,
        "ttft_p90_s": None,
    }
    json.loads(json.dumps(summarize([req(0, 0, 0.0, 1.0, 0.3)])), parse_constant=pytest.fail)
    s = summarize(rows)
    assert s["arrivals"] == {"alone": 3, "queued": 2} and s["ttft_by_round_arrival"] == split


def test_the_csv_records_each_requests_arrival(tmp_path):
    rows = [req(0, 0, 0.0, 2.0, 0.4), req(1, 0, 1.0, 3.0, 1.0), req(0, 1, 5.0, 6.0, 0.2)]
    write_csv(tmp_path / "r.csv", rows)
    with open(tmp_path / "r.csv", newline="") as f:
        reader = csv.DictReader(f)
        got = list(reader)
    assert reader.fieldnames == COLUMNS + ARRIVAL_COLUMNS  # LMBenchmark's columns first
    assert [(g["others_in_flight"], g["arrival"]) for g in got] == [
        ("0", "alone"),
        ("1", "queued"),
        ("0", "alone"),
    ]


def _args(**kw):
    return argparse.Namespace(
        workload="multi-round",
        model="m",
        engine_kv_blocks=48,
        block_size=128,
        serve_arg=[],
        cpu_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        num_users=2,
        num_rounds=2,
        lmbenchmark_dir=None,
        **kw,
    )


def _table(text: str) -> dict[tuple[str, str], list[str]]:
    """The per-round-and-arrival table's rows by (round, arrival)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if re.fullmatch(r"(round \d+|every round)", cells[0]) and len(cells) > 2:
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_report_gives_ttft_per_round_and_arrival_with_the_ratio_per_row():
    # vLLM: round 1 recomputes; KVBM: round 1 hits; user 1's round 0 queues in both
    plain = [
        req(0, 0, 0.0, 2.0, 0.5),
        req(1, 0, 1.0, 3.5, 1.5),
        req(0, 1, 10.0, 11.0, 0.6),
        req(1, 1, 20.0, 21.0, 0.8),
    ]
    kvbm = [
        req(0, 0, 0.0, 2.0, 0.5),
        req(1, 0, 1.0, 3.5, 1.5),
        req(0, 1, 10.0, 10.5, 0.2),
        req(1, 1, 20.0, 20.5, 0.2),
    ]
    runs = [
        ConfigRun("kvbm-host", "ok", summary=summarize(kvbm), results=kvbm),
        ConfigRun("vllm", "ok", summary=summarize(plain), results=plain),
        ConfigRun("lmcache", "did not start", reason="no"),
    ]
    text = report(runs, _args(), "kvbm-bench compare")
    assert (
        "| round | arrival | vLLM + KVBM (host) requests | mean | p50 | p90 "
        "| vLLM prefix caching requests | mean | p50 | p90 | vllm / kvbm-host |"
    ) in text
    rows = _table(text)
    # vLLM's prefix cache is the baseline even when it ran second
    assert rows[("round 1", "alone")] == [
        "2",
        "200",
        "200",
        "200",
        "2",
        "700",
        "700",
        "780",
        "3.5x",
    ]
    assert rows[("round 0", "queued")] == [
        "1",
        "1500",
        "1500",
        "1500",
        "1",
        "1500",
        "1500",
        "1500",
        "1.0x",
    ]
    assert (
        rows[("every round", "all")][0] == "4"
        and rows[("every round", "all")][-1]
        == f"{(0.5 + 1.5 + 0.6 + 0.8) / (0.5 + 1.5 + 0.2 + 0.2):.1f}x"
    )
    assert ("round 1", "queued") not in rows  # no request of either run
    assert list(rows)[:3] == [("round 0", "all"), ("round 0", "alone"), ("round 0", "queued")]


def test_report_of_servers_by_url_compares_each_with_the_first():
    a = [req(0, 0, 0.0, 1.0, 0.4), req(0, 1, 2.0, 3.0, 0.4)]
    b = [req(0, 0, 0.0, 1.0, 0.4), req(0, 1, 2.0, 3.0, 0.1)]
    c = [req(0, 0, 0.0, 1.0, 0.8)]
    runs = [
        ConfigRun(n, "ok", summary=summarize(rs), results=rs, url=f"http://{n}:8000")
        for n, rs in (("a", a), ("b", b), ("c", c))
    ]
    text = report(
        runs,
        _args(url=[("a", "http://a:8000"), ("b", "http://b:8000"), ("c", "http://c:8000")]),
        "kvbm-bench compare",
    )
    rows = _table(text)
    assert "| a / b | a / c |" in text
    assert rows[("round 1", "alone")][-2:] == ["4.0x", "-"]  # c ran no round 1
    assert rows[("round 0", "alone")][-2:] == ["1.0x", "0.5x"]
