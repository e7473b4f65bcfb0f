"""kvbm-bench's parts that need no server: the core checks on process trees
laid out as `vllm serve`'s, the comparison report, arrival pacing, the plots
(test_bench_serve_args.py: the serve arguments; tests/e2e/test_bench_e2e.py
runs the client and compare against a real server)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_kvbm.bench.client import Result, arrival_gaps, concurrency, summarize
from vllm_kvbm.bench.compare import ConfigRun, unequal_cores
from vllm_kvbm.bench.cores import Binding, check_equal, fair_cpu_env, process_binding
from vllm_kvbm.bench.lmbenchmark import lmbenchmark_problem
from vllm_kvbm.bench.report import report

pytestmark = pytest.mark.timeout(300)

# ---- fair comparisons: the cores each configuration ran on ------------------------------

DATA = Path(__file__).resolve().parents[1] / "data"
CPUS = sorted(os.sched_getaffinity(0))

# A process of the tree `vllm serve` starts (API server -> VLLM::EngineCore ->
# VLLM::Worker[_TPn], titled as vLLM titles them). argv: its spec (JSON), this
# source. A worker pins as vLLM's CPU worker does: its first thread to the
# first OpenMP core, one thread to each further core; other threads pinned to
# several cores (KVBM's I/O threads widen themselves to the machine).
NODE = """
import json, os, subprocess, sys, threading, time
spec, source = json.loads(sys.argv[1]), sys.argv[2]
for child in spec.get("children", []):
    subprocess.Popen([child["title"], "-c", source, json.dumps(child), source],
                     executable=child["exe"])
pins = [{int(c) for c in p.split(",")} for p in spec.get("pins", "").split(";") if p]
if pins:
    os.sched_setaffinity(0, pins[0])
def pinned(cpus):
    os.sched_setaffinity(0, cpus)
    time.sleep(300)
for cpus in pins[1:]:
    threading.Thread(target=pinned, args=(cpus,), daemon=True).start()
if spec.get("ready"):
    time.sleep(0.2)
    open(spec["ready"], "w").close()
time.sleep(300)
"""


@pytest.fixture
def engine_tree(tmp_path):
    """Starts a `vllm serve`-shaped process tree, one worker per pins
    argument (TP ranks); returns its root pid once every worker pinned."""
    started = []

    def start(*pins: str) -> int:
        workers = [
            {
                "title": f"VLLM::Worker{f'_TP{i}' if len(pins) > 1 else ''}",
                "pins": p,
                "ready": str(tmp_path / f"ready-{len(started)}-{i}"),
                "exe": sys.executable,
            }
            for i, p in enumerate(pins)
        ]
        spec = {
            "children": [{"title": "VLLM::EngineCore", "children": workers, "exe": sys.executable}]
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", NODE, json.dumps(spec), NODE], start_new_session=True
        )
        started.append(proc)
        deadline = time.monotonic() + 60
        while not all(Path(w["ready"]).exists() for w in workers):
            assert time.monotonic() < deadline and proc.poll() is None, "no workers started"
            time.sleep(0.05)
        return proc.pid

    yield start
    for proc in started:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to pin to")
def test_core_check_catches_unequal_cores_of_running_engines(engine_tree):
    """Process trees laid out and pinned as vLLM CPU 0.32 lays them out on 2
    cores: by default the engine with a kv_transfer_config got both cores and
    the plain one got one (tests/e2e/test_bench_e2e.py reads a real server)."""
    a, b = CPUS[:2]
    rest = tuple(c for c in CPUS if c not in (a, b))
    plain = process_binding(engine_tree(f"{a}"))
    kvbm = process_binding(engine_tree(f"{a};{b}"))
    # the fair binding: one OpenMP core; KVBM's I/O threads span both
    fair = process_binding(engine_tree(f"{a};{a},{b};{a},{b}"))
    assert plain.cores == ((a,),) and plain.reserved == (b, *rest)
    assert kvbm.cores == ((a, b),) and kvbm.reserved == rest
    assert fair.cores == ((a,),) and fair.threads == 1
    problem = check_equal({"vllm": plain, "kvbm-host": kvbm})
    assert f"vllm: cores {a} (1 OMP thread)" in problem
    assert f"kvbm-host: cores {a},{b} (2 OMP threads)" in problem
    assert check_equal({"vllm": plain, "kvbm-host": fair}) == ""
    # an engine whose processes were not found cannot vouch for its cores
    assert "unknown" in check_equal({"vllm": plain, "kvbm-host": None})
    assert check_equal({"vllm": plain, "remote": None}, unknown_ok=True) == ""
    tp2 = process_binding(engine_tree(f"{a}", f"{b}"))
    assert tp2.cores == ((a,), (b,)) and tp2.describe() == f"cores {a} | {b} (2 OMP threads)"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert process_binding(gone.pid) is None


def test_compare_report_marks_unequal_cores_and_prints_them(tmp_path):
    args = argparse.Namespace(
        workload="multi-round",
        model="m",
        engine_kv_blocks=40,
        block_size=128,
        serve_arg=[],
        cpu_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        num_users=1,
        num_rounds=1,
        lmbenchmark_dir=None,
    )
    result = Result(10, 2, 0.5, 0.1, 0, 0, 100.0, 100.6)
    runs = []
    # as vLLM bound them on 2 cores by default (test above)
    for name, binding in (("vllm", Binding(((0,),), (1,))), ("kvbm-host", Binding(((0, 1),)))):
        runs.append(
            ConfigRun(
                name,
                "ok",
                summary=summarize([result]),
                results=[result],
                counters={
                    "prefix_hits": 0,
                    "prefix_queries": 0,
                    "kvbm_tokens": {"host": 0, "disk": 0},
                },
                binding=binding,
            )
        )
    text = report(runs, args, "kvbm-bench compare")
    assert text.splitlines()[2].startswith(
        "**NOT COMPARABLE: the configurations did not run on the same cores"
    )
    assert "| vLLM prefix caching | ok | cores 0 (1 OMP thread) |" in text
    assert "| vLLM + KVBM (host) | ok | cores 0,1 (2 OMP threads) |" in text
    runs[1].binding = Binding(((0,),))  # with VLLM_CPU_NUM_OF_RESERVED_CPU=1
    fair = report(runs, args, "kvbm-bench compare")
    assert "NOT COMPARABLE" not in fair and unequal_cores(runs) == ""
    assert "| vLLM + KVBM (host) | ok | cores 0 (1 OMP thread) |" in fair


def test_every_configuration_gets_the_same_binding_env():
    assert fair_cpu_env({}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert fair_cpu_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1"
    }
    assert fair_cpu_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, reserved=1) == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"
    }


def test_arrival_pattern_and_concurrency():
    # LMBenchmark: 4 users at 0.5 QPS -> rounds 8 s apart, users join 8 * 2 / 4 s apart
    assert arrival_gaps(4, 3, 0.5) == (8.0, 4.0)
    rows = [
        Result(1, 1, 0.1, 0.1, 0, 0, 0.0, 3.0),
        Result(1, 1, 0.1, 0.1, 1, 0, 1.0, 2.0),
        Result(1, 1, 0.1, 0.1, 2, 0, 2.0, 4.0),
        Result(1, 1, 0.1, 0.1, 0, 1, 4.0, 5.0),
    ]
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


# ---- vLLM's own offloading beside KVBM: configurations and why one did not start ---------

NATIVE_CAUSE = "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_startup_error_is_the_root_cause_line_of_real_server_logs():
    """Real `vllm serve` logs (vLLM CPU 0.32) of vLLM's offloading failing at
    startup: the cause, not vLLM's wrappers around it nor a traceback."""
    from vllm_kvbm.bench.server_logs import startup_error

    assert startup_error(DATA / "vllm-serve-kv-offloading-size.log") == NATIVE_CAUSE
    assert startup_error(DATA / "vllm-serve-simple-cpu-offload.log") == (
        "AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'"
    )
    assert startup_error(DATA / "vllm-serve-plain-auto.log") == ""  # a server that started
    assert startup_error(DATA / "no-such.log") == ""


def test_native_offloading_configurations_are_what_vllm_reads():
    """The serve flags parse in the installed vLLM to the size asked for, and the
    connectors named in kv_transfer_config are registered in it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_kvbm.bench.compare import (
        ALL_CONFIGS,
        LABELS,
        NATIVE_CONNECTORS,
        config_serve_args,
        transfer_config,
    )

    args = argparse.Namespace(
        host_cache_size="1536MiB", engine_kv_blocks=40, block_size=128, serve_arg=[]
    )
    flags = config_serve_args("vllm-offload", args)
    assert flags[-4:] == ["--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"]
    assert transfer_config("vllm-offload", args, Path(".")) is None
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", "m", *flags[-4:]]
    )
    assert parsed.kv_offloading_size == 1.5 and parsed.kv_offloading_backend == "native"
    for name, connector in NATIVE_CONNECTORS.items():
        config = transfer_config(name, args, Path("."))
        assert config["kv_connector"] == connector in KVConnectorFactory._registry
        assert config["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1536 << 20}
        assert config_serve_args(name, args) == config_serve_args("vllm", args)
        assert name in ALL_CONFIGS and name in LABELS
    assert {"vllm-offload", "lmcache"} <= set(ALL_CONFIGS)


def test_compare_report_prints_why_a_configuration_did_not_start(tmp_path):
    from vllm_kvbm.bench.server_logs import startup_error

    args = argparse.Namespace(
        workload="multi-round",
        model="m",
        engine_kv_blocks=40,
        block_size=128,
        serve_arg=[],
        cpu_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        num_users=1,
        num_rounds=2,
        lmbenchmark_dir=None,
        host_cache_size="1GiB",
    )
    rows = [
        Result(2000, 8, 0.5, 0.1, 0, 0, 100.0, 100.6),
        Result(2600, 8, 0.25, 0.1, 0, 1, 101.0, 101.4),
    ]
    log = DATA / "vllm-serve-kv-offloading-size.log"
    runs = [
        ConfigRun(
            "vllm",
            "ok",
            summary=summarize(rows),
            results=rows,
            counters={"prefix_hits": 128, "prefix_queries": 256},
        ),
        ConfigRun(
            "vllm-offload",
            "did not start",
            reason=startup_error(log),
            wall_s=61,
            error=f"RuntimeError: vllm serve exited with 1 during startup; errors in "
            f"{log}:\nserver log: {log}",
        ),
    ]
    text = report(runs, args, "kvbm-bench compare --configs vllm vllm-offload")
    assert "| vLLM prefix caching | ok | - | 2/2 | 1 | 375 | " in text
    assert "| 50% | - |" in text  # the plain row's prefix hit rate
    assert (
        f"| vLLM --kv-offloading-size (native) | does not start: {NATIVE_CAUSE} | - | 0/2 |"
    ) in text
    assert "did not start (after 61 s)" in text and f"server log: {log}." in text
    assert "`--kv-offloading-size 1 --kv-offloading-backend native`" in text
    assert "Traceback" not in text and "Worker failed" not in text
    # a server that ran while its connector logged errors says so in its row
    runs.append(
        ConfigRun(
            "lmcache",
            "ok",
            summary=summarize(rows),
            results=rows,
            counters={"lmcache_hit_tokens": 0},
            log_errors="RuntimeError: No supported cpu connector found.",
        )
    )
    text = report(runs, args, "kvbm-bench compare")
    assert "| vLLM + LMCacheConnectorV1 | ok, errors in its log (below) | - | 2/2 |" in text
    assert "RuntimeError: No supported cpu connector found." in text


def test_a_failed_start_leaves_no_process_and_frees_its_port():
    """A server whose first process exits during startup while a child it
    started still listens (vLLM's engine core after the API server died):
    stopping it kills the child and frees the port."""
    import subprocess

    from vllm_kvbm.tools.server import _stop, free_port, group_alive, port_free

    port = free_port()
    child = (
        "import socket, time; s = socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(120)"
    )
    leader = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(2); sys.exit(1)"
    )
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    assert proc.wait(timeout=60) == 1
    assert group_alive(proc.pid) and not port_free(port)  # the child outlived its parent
    _stop(proc)
    assert not group_alive(proc.pid) and port_free(port)


def test_log_errors_tells_a_warning_from_an_error(tmp_path):
    """vLLM's oneDNN fallback notice on CPUs without native bf16 quotes an
    exception at WARNING level: a notice, not an error of the run."""
    from vllm_kvbm.bench.server_logs import log_errors

    log = tmp_path / "server.log"
    warn = (
        "(EngineCore pid=7) WARNING 12-05 03:40:01 [utils.py:597] Failed to create oneDNN "
        "linear, fallback to torch linear. Exception: could not create a primitive"
    )
    ulimit = "(APIServer pid=6) WARNING 12-05 03:40:00 [system_utils.py:80] Found ulimit of 1024"
    log.write_text(f"{ulimit}\n{warn}\nINFO 12-05 03:40:02 [api_server.py:1] Error rate 0\n")
    assert log_errors(log, fallback=False) == ""
    err = "(Worker pid=9) ERROR 12-05 03:40:03 [multiproc_executor.py:1063] RuntimeError: boom"
    log.write_text(f"{warn}\n{err}\nValueError: raised outside a logger\n")
    assert log_errors(log, fallback=False).splitlines() == [
        "RuntimeError: boom",
        "ValueError: raised outside a logger",
    ]


def test_configurations_this_platform_cannot_run_are_marked_not_raced(tmp_path, capsys):
    """On vLLM's CPU build, vLLM's own offloading (CUDA/XPU only) and LMCache's
    connector (CUDA only) are marked "not supported on CPU" with the reason and
    never started: no server log, no row of failed-start timings."""
    from vllm_kvbm.bench.__main__ import main
    from vllm_kvbm.bench.platforms import unsupported_here
    from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

    unsupported = ["vllm-offload", "offloading-connector", "simple-cpu-offload", "lmcache"]
    for name in unsupported:
        assert unsupported_here(name).startswith("not supported on CPU: "), name
    for name in ("vllm", "kvbm-host", "kvbm-host-disk"):
        assert unsupported_here(name) == ""
    out = tmp_path / "compare"
    rc = main(
        [
            "compare",
            "--model",
            str(build(DEFAULT_DIR)),
            "--configs",
            *unsupported,
            "--out-dir",
            str(out),
            "--num-users",
            "1",
            "--num-rounds",
            "1",
        ]
    )
    assert rc == 2 and "no configuration asked for runs on this platform" in capsys.readouterr().err
    text = (out / "report.md").read_text()
    assert (
        "| vLLM --kv-offloading-size (native) | not supported on CPU: vLLM's CPU "
        "offloading needs a CUDA-alike or XPU GPU | - | 0/1 |"
    ) in text
    assert (
        "| vLLM + LMCacheConnectorV1 | not supported on CPU: LMCacheConnectorV1 moves KV "
        "with a CUDA GPU |"
    ) in text
    assert "did not start" not in text and not list(out.glob("server-*.log"))


def test_percentiles_are_numpys_linear_interpolation():
    rows = [Result(1, 1, t, 0.1, 0, 0, 0.0, 1.0) for t in (0.1, 0.2, 0.3, 0.4)]
    s = summarize(rows)
    # between the two nearest ranks: p50 of 4 values is the mean of the middle two
    assert s["ttft_p50_s"] == pytest.approx(0.25) and s["ttft_p90_s"] == pytest.approx(0.37)
    assert s["ttft_p99_s"] == pytest.approx(0.397)


def test_plots_answer_one_question_each_at_a_readable_size(tmp_path):
    from PIL import Image

    from vllm_kvbm.bench.plots import plots
    from vllm_kvbm.bench.report import hit_tokens

    rows = [
        Result(2000, 8, t, 0.1, u, q, 100.0 + q, 100.5 + q)
        for u in (0, 1)
        for q, t in enumerate((0.5, 0.2, 0.1))
    ]
    runs = [
        ConfigRun(
            "vllm",
            "ok",
            summary=summarize(rows),
            results=rows,
            counters={"prefix_hits": 3000, "prefix_queries": 12000},
        ),
        ConfigRun(
            "kvbm-host",
            "ok",
            summary=summarize(rows),
            results=rows,
            counters={
                "prefix_hits": 3000,
                "prefix_queries": 12000,
                "kvbm_tokens": {"host": 6000, "disk": 0, "pool": 512},
            },
        ),
        ConfigRun("lmcache", "did not start"),
    ]
    assert hit_tokens(runs[1]) == "host 6000, disk 0, pool 512" and hit_tokens(runs[0]) == "-"
    paths = plots(runs, tmp_path, "multi-round")
    assert [p.name for p in paths] == [
        "ttft_per_round.png",
        "ttft_by_arrival.png",
        "hit_tokens.png",
        "ttft_distribution.png",
    ]
    for path in paths:
        with Image.open(path) as image:
            assert image.size == (1200, 675), path.name


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_kvbms_layer_copy_thread_is_not_read_as_an_openmp_thread():
    """pinned to one core as OpenMP's threads are, but named kvbm-...: an
    engine with KVBM reads as bound like one without."""
    import threading

    import psutil

    from vllm_kvbm.bench.cores import pinned_cores
    from vllm_kvbm.cpus import name_os_thread

    ready, done = threading.Event(), threading.Event()

    def copier(name):
        name_os_thread(name)
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        ready.set()
        done.wait(10)

    everything = tuple(sorted(os.sched_getaffinity(0)))
    for name, expected in (("kvbm-layer-copy", everything), ("omp", everything[:1])):
        ready.clear()
        done.clear()
        t = threading.Thread(target=copier, args=(name,))
        t.start()
        try:
            assert ready.wait(10)
            assert pinned_cores(psutil.Process()) == expected
        finally:
            done.set()
            t.join(10)
