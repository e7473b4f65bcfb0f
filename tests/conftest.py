"""Shared fixtures: the local model and real vLLM engines (one per session).

Engines are expensive to start (tens of seconds on two cores), so each kind
is started once per test session and shared; tests read counter deltas.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from vllm_kvbm.tools.server import free_port, kvbm_transfer_config

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(os.environ.get("KVBM_TEST_MODEL", ROOT / "models" / "kvbm-llama-8l"))
BLOCK_SIZE = 128
# Enough host slots for the correctness tests; the capacity test overfills it.
HOST_BLOCKS = 96

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def make_llm(kv_transfer_config: dict | None = None, **overrides):
    from vllm import LLM

    args = dict(
        model=str(MODEL_DIR),
        # float32: in bfloat16, vLLM's own prefix-cache hits already change
        # near-tie greedy tokens against a full recompute (the attention over
        # cached KV rounds differently), which would hide what is under test.
        dtype="float32",
        max_model_len=8192,
        max_num_batched_tokens=8192,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        # Eager on both engines: the compiled and eager paths round differently,
        # and the comparison must differ only in where the KV came from.
        enforce_eager=True,
        gpu_memory_utilization=0.25,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
    )
    args.update(overrides)
    return LLM(**args)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from vllm_kvbm.tools.local_model import build

    return build(MODEL_DIR)


@pytest.fixture(scope="session")
def plain_llm(model_dir):
    llm = make_llm(None)
    yield llm
    llm.llm_engine.engine_core.shutdown()


# The kvbm engine also serves its metrics on a standalone port.
KVBM_METRICS_PORT = free_port()


@pytest.fixture(scope="session")
def kvbm_llm(model_dir):
    llm = make_llm(kvbm_transfer_config(host_cache_blocks=HOST_BLOCKS,
                                        metrics_port=KVBM_METRICS_PORT,
                                        metrics_host="127.0.0.1"))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 7000) for _ in range(n)]


def kvbm_counter(name: str) -> float:
    """Sum of a kvbm_ counter over engines, from this process's registry."""
    from prometheus_client import REGISTRY

    total = 0.0
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == f"kvbm_{name}_total":
                total += sample.value
    return total


def vllm_counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples
               if s.name == f"{name}_total")


def mount_tmpfs(mnt, opts: str) -> None:
    """A real small or read-only filesystem for fault tests (root ignores
    permission bits, not a read-only mount); skips where mounting is refused."""
    os.makedirs(mnt, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); fault not produced")


def stop_every_thread(proc: subprocess.Popen, what: str, timeout: float = 5.0) -> None:
    """SIGSTOP a server (a frozen-server fault), and wait until every one of
    its threads has stopped."""
    from vllm_kvbm.tools.server import freeze_process

    freeze_process(proc, what, timeout)


@pytest.fixture(scope="module")
def lm_server():
    """A real LMCache server for one test module, always killed."""
    from lm_server import LMServer

    srv = LMServer()
    srv.start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def umount(mnt) -> None:
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


@pytest.fixture
def relay(lm_server):
    """A relay in front of the module's LMCache server whose connections can
    be frozen one by one (tests/tcp_relay.py)."""
    from tcp_relay import Relay

    lm_server.wait_ready()
    r = Relay(lm_server.port)
    yield r
    r.close()


class Ext4:
    """A real ext4 filesystem (a loop-mounted image) a test can freeze:
    ``fsfreeze`` blocks every write and metadata update on it (a read's
    atime/utime touch included) until thawed, as a filesystem snapshot or
    a hung device does."""

    def __init__(self, mnt: Path):
        self.path = mnt
        self.frozen = False

    def freeze(self) -> None:
        subprocess.run(["fsfreeze", "-f", str(self.path)], check=True, timeout=20)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.path)], check=True, timeout=20)
            self.frozen = False


@pytest.fixture
def ext4(tmp_path):
    """An Ext4 under tmp_path; skips where loop mounts are refused. Always
    thawed and unmounted afterwards (a frozen filesystem left behind would
    hang every later writer)."""
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    steps = [["truncate", "-s", "256M", str(img)], ["mkfs.ext4", "-q", "-F", str(img)],
             ["mount", "-o", "loop", str(img), str(mnt)]]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot make a loop-mounted ext4 here ({e}); fault not produced")
        if r.returncode != 0:
            pytest.skip(f"cannot make a loop-mounted ext4 here ({cmd[0]}: "
                        f"{r.stderr.strip()}); fault not produced")
    fs = Ext4(mnt)
    try:
        yield fs
    finally:
        fs.thaw()
        # Lazily: fixtures set up earlier (a worker and its disk tier) are torn
        # down after this one and may still hold files open here.
        umount(mnt)
