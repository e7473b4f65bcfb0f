"""Shared fixtures: the local model, real vLLM engines (one per session) and
real servers; the unit/e2e markers. Helpers live in tests/helpers/.

Engines are expensive to start (tens of seconds on two cores), so each kind
is started once per test session and shared; tests read counter deltas.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers.engines import HOST_BLOCKS, KVBM_METRICS_PORT, MODEL_DIR, make_llm, shutdown
from helpers.system import Ext4, shm_dir, umount
from vllm_kvbm.tools.server import kvbm_transfer_config

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def _bind_xdist_worker_to_a_core() -> None:
    """Under pytest-xdist (scripts/test.sh's two workers) each worker's
    engines compute on a core of their own (vLLM's automatic binding would put both
    workers' engines on the first core). Engines compared with each other
    run in one worker, so they stay bound alike; tests that bind otherwise
    (TP=2: one core per rank) set the variable themselves."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or workers > len(cores):
        return
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


_bind_xdist_worker_to_a_core()


def _engine_sockets_in_a_directory_of_their_own() -> None:
    """vLLM names its engines' ZMQ IPC sockets in VLLM_RPC_BASE_PATH (the
    temporary directory by default) and leaves them there when a process is
    killed, as tests that kill engines do: hundreds a run. A test run's go
    into a directory of its own, removed at exit."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="kvbm-tests-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    atexit.register(shutil.rmtree, path, True)


_engine_sockets_in_a_directory_of_their_own()

TESTS = Path(__file__).resolve().parent
# tests/unit: no engine, no server process (scripts/test.sh --fast);
# tests/e2e: real engines and servers.
TIERS = {TESTS / "unit": "unit", TESTS / "e2e": "e2e"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = TIERS.get(Path(str(item.path)).parent)
        if tier:
            item.add_marker(tier)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from vllm_kvbm.tools.local_model import build

    return build(MODEL_DIR)


@pytest.fixture(scope="session")
def plain_llm(model_dir):
    llm = make_llm(None)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def kvbm_llm(model_dir):
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS, metrics_port=KVBM_METRICS_PORT, metrics_host="127.0.0.1"
        )
    )
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def lm_server():
    """A real LMCache server for one test module, always killed."""
    from helpers.lm_server import LMServer

    srv = LMServer()
    srv.start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def relay(lm_server):
    """A relay in front of the module's LMCache server whose connections can
    be frozen one by one (tests/helpers/tcp_relay.py)."""
    from helpers.tcp_relay import Relay

    lm_server.wait_ready()
    r = Relay(lm_server.port)
    yield r
    r.close()


@pytest.fixture
def mount(tmp_path):
    """A FUSE passthrough of tmp_path whose metadata calls can be made to
    block (helpers/blocking_fs.py), as a hung network filesystem's do;
    skips where FUSE is missing. Always unmounted afterwards."""
    from helpers import blocking_fs

    why = blocking_fs.available()
    if why is not None:
        pytest.skip(f"no blocking FUSE mount here: {why} (scripts/setup_tools.sh installs it)")
    m = blocking_fs.BlockingMount(tmp_path, max_block_s=30.0)
    yield m
    m.close()


@pytest.fixture
def ext4(tmp_path):
    """An Ext4 under tmp_path; skips where loop mounts are refused. Always
    thawed and unmounted afterwards (a frozen filesystem left behind would
    hang every later writer)."""
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    steps = [
        ["truncate", "-s", "256M", str(img)],
        ["mkfs.ext4", "-q", "-F", str(img)],
        ["mount", "-o", "loop", str(img), str(mnt)],
    ]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot make a loop-mounted ext4 here ({e}); fault not produced")
        if r.returncode != 0:
            pytest.skip(
                f"cannot make a loop-mounted ext4 here ({cmd[0]}: "
                f"{r.stderr.strip()}); fault not produced"
            )
    fs = Ext4(mnt)
    try:
        yield fs
    finally:
        fs.thaw()
        # Lazily: fixtures set up earlier (a worker and its disk tier) are torn
        # down after this one and may still hold files open here.
        umount(mnt)


@pytest.fixture
def shm():
    with shm_dir() as d:
        yield d


@pytest.fixture
def procs():
    """Processes a test started (each its own session), always killed after it,
    a stopped one included."""
    started: list = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
