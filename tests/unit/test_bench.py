"""kvbm-bench's parts that need no server: the core checks on real `vllm serve`
logs, the comparison report, arrival pacing (tests/e2e/test_bench_e2e.py runs
the client against a real server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from vllm_kvbm.bench.client import Result, arrival_gaps, concurrency, summarize
from vllm_kvbm.bench.compare import ConfigRun, lmbenchmark_problem, report, unequal_cores
from vllm_kvbm.bench.cores import check_equal, fair_cpu_env, parse_binding, read_binding

pytestmark = pytest.mark.timeout(300)

# ---- fair comparisons: the cores each configuration ran on ------------------------------

DATA = Path(__file__).resolve().parents[1] / "data"


def test_core_check_catches_unequal_cores_in_real_server_logs():
    """Real `vllm serve` logs (vLLM CPU 0.32, 2 cores): by default the engine
    with a kv_transfer_config got both cores and the plain one got one."""
    plain = read_binding(DATA / "vllm-serve-plain-auto.log")
    kvbm = read_binding(DATA / "vllm-serve-kvbm-auto.log")
    fair = read_binding(DATA / "vllm-serve-kvbm-reserved1.log")
    assert plain.cores == ((0,),) and plain.reserved == (1,) and plain.reserve == 1
    assert kvbm.cores == ((0, 1),) and kvbm.reserved == () and kvbm.reserve == 2
    assert fair.cores == ((0,),) and fair.threads == 1
    problem = check_equal({"vllm": plain, "kvbm-host": kvbm})
    assert "vllm: cores 0 (1 OMP thread)" in problem
    assert "kvbm-host: cores 0,1 (2 OMP threads)" in problem
    assert check_equal({"vllm": plain, "kvbm-host": fair}) == ""
    # a log without the binding line cannot vouch for its cores
    assert "unknown" in check_equal({"vllm": plain, "kvbm-host": None})
    assert parse_binding("INFO no binding here\n") is None


def test_compare_report_marks_unequal_cores_and_prints_them(tmp_path):
    args = argparse.Namespace(
        workload="multi-round", model="m", engine_kv_blocks=40, block_size=128, serve_arg=[],
        cpu_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, num_users=1, num_rounds=1,
        lmbenchmark_dir=None)
    result = Result(10, 2, 0.5, 0.1, 0, 0, 100.0, 100.6)
    runs = []
    for name, log in (("vllm", "vllm-serve-plain-auto.log"),
                      ("kvbm-host", "vllm-serve-kvbm-auto.log")):
        runs.append(ConfigRun(name, "ok", summary=summarize([result]), results=[result],
                              counters={"prefix_hits": 0, "prefix_queries": 0,
                                        "kvbm_host_tokens": 0, "kvbm_disk_tokens": 0},
                              binding=read_binding(DATA / log)))
    text = report(runs, args, "kvbm-bench compare")
    assert text.splitlines()[2].startswith("**NOT COMPARABLE: the configurations did not "
                                           "run on the same cores")
    assert "| vLLM prefix caching | ok | cores 0 (1 OMP thread) |" in text
    assert "| vLLM + KVBM (host) | ok | cores 0,1 (2 OMP threads) |" in text
    runs[1].binding = read_binding(DATA / "vllm-serve-kvbm-reserved1.log")
    fair = report(runs, args, "kvbm-bench compare")
    assert "NOT COMPARABLE" not in fair and unequal_cores(runs) == ""
    assert "| vLLM + KVBM (host) | ok | cores 0 (1 OMP thread) |" in fair


def test_every_configuration_gets_the_same_binding_env():
    assert fair_cpu_env({}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert fair_cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert fair_cpu_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, reserved=1) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_arrival_pattern_and_concurrency():
    # LMBenchmark: 4 users at 0.5 QPS -> rounds 8 s apart, users join 8 * 2 / 4 s apart
    assert arrival_gaps(4, 3, 0.5) == (8.0, 4.0)
    rows = [Result(1, 1, 0.1, 0.1, 0, 0, 0.0, 3.0), Result(1, 1, 0.1, 0.1, 1, 0, 1.0, 2.0),
            Result(1, 1, 0.1, 0.1, 2, 0, 2.0, 4.0), Result(1, 1, 0.1, 0.1, 0, 1, 4.0, 5.0)]
    peak, mean = concurrency(rows)
    assert peak == 2  # a finish and a launch at the same instant do not overlap
    assert mean == pytest.approx((3 + 1 + 2 + 1) / 5)
    assert summarize(rows)["max_in_flight"] == 2


def test_compare_refuses_an_lmbenchmark_dir_that_cannot_run(tmp_path):
    args = argparse.Namespace(lmbenchmark_dir=str(tmp_path), lmbenchmark_python=sys.executable)
    assert "not an LMBenchmark checkout" in lmbenchmark_problem(args)
    qa = tmp_path / "synthetic-multi-round-qa"
    qa.mkdir()
    (qa / "multi-round-qa.py").write_text("import no_such_module_for_lmbenchmark\n")
    assert "does not start" in lmbenchmark_problem(args)
    assert "no_such_module_for_lmbenchmark" in lmbenchmark_problem(args)
