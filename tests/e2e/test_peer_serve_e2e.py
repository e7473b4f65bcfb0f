"""Peers as an operator runs them: two `vllm serve` processes and one
`kvbm-pool`, UCX over TCP as between machines (``UCX_TLS=tcp,self``: no
shared-memory or cross-memory copy between the processes).

Engine A keeps its pool in a file kvbm-pool holds and serves (pool_socket);
engine B reads peers (peer_reads). A prefix A computed comes to B over the
OpenAI API's kv_transfer_params (a router's hint naming kvbm-pool's endpoint):
B's greedy tokens equal B's own recompute of the prompt. A killed, its pages
are still served by kvbm-pool (the pool outlives its engine); kvbm-pool
killed too, a hinted request costs a recompute, in bounded time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers.system import shm_dir
from helpers.engines import MODEL_DIR, RECOMPUTE, random_prompt
from test_request_params_e2e import PAGE, SERVE_ARGS, Client
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(1800)

UCX = {"UCX_TLS": "tcp,self", "VLLM_SERVER_DEV_MODE": "1"}
TOKENS = 16


def complete(client: Client, prompt: list[int], params: dict | None) -> tuple[list[int], int]:
    """(greedy tokens, tokens cached) of a 16-token completion, vLLM's own
    prefix cache emptied first."""
    client.reset()
    body = {"model": client.server.model, "prompt": prompt, "max_tokens": TOKENS,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{client.server.url}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    choice = out["choices"][0]
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return choice["logprobs"]["tokens"], cached


@pytest.fixture(scope="module")
def shm():
    with shm_dir("kvbm-e2e-peer-serve-") as d:
        yield d


@pytest.fixture(scope="module")
def pool(shm):
    """kvbm-pool serving on 127.0.0.1: (its process, its rank-0 endpoint, its socket)."""
    port, sock = free_port(), os.path.join(shm, "pool.sock")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_kvbm.tools.pool", "--dir", shm,
                             "--socket", sock, "--serve-port", str(port),
                             "--serve-host", "127.0.0.1"], env={**os.environ, **UCX},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run([sys.executable, "-m", "vllm_kvbm.tools.pool", "--check", "--socket",
                          sock], capture_output=True).returncode != 0:
        assert proc.poll() is None and time.monotonic() < deadline, "kvbm-pool did not start"
        time.sleep(0.5)
    yield proc, f"tcp://127.0.0.1:{port}", sock
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def engines(model_dir, shm, pool, tmp_path_factory):
    _, _, sock = pool
    a_kv = kvbm_transfer_config(host_cache_blocks=6, pool_cache_size="64MiB", pool_dir=shm,
                                pool_socket=sock, load_split=False)
    b_kv = kvbm_transfer_config(host_cache_blocks=6, peer_reads=True, load_split=False)
    logs = tmp_path_factory.mktemp("logs")
    with vllm_server(str(MODEL_DIR), a_kv, SERVE_ARGS, env=UCX, startup_timeout=900,
                     log_path=logs / "a.log") as a, \
            vllm_server(str(MODEL_DIR), b_kv, SERVE_ARGS, env=UCX, startup_timeout=900,
                        log_path=logs / "b.log") as b:
        yield Client(a), Client(b)


def test_served_engines_share_a_prefix_through_kvbm_pool_which_outlives_its_engine(
        engines, pool):
    a, b = engines
    proc, endpoint, _ = pool
    hint = {"router_hint": {"source_control_endpoint": endpoint}}
    prompts = [random_prompt(3 * PAGE + 10, seed=9500 + i) for i in range(3)]
    want = [complete(b, p, RECOMPUTE)[0] for p in prompts]  # B's own recompute
    for p in prompts:
        complete(a, p, None)  # A computes them: its pool (kvbm-pool's file) gets them
    time.sleep(2.0)  # the write-through lands
    got, cached = complete(b, prompts[0], hint)
    assert got == want[0] and cached == 3 * PAGE

    # A dies; kvbm-pool still holds its pages and serves them
    os.killpg(a.server.process.pid, signal.SIGKILL)
    a.server.process.wait(60)
    got, cached = complete(b, prompts[1], hint)
    assert got == want[1] and cached == 3 * PAGE

    # kvbm-pool dies too: the hint names nobody; a recompute, in bounded time
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    t0 = time.monotonic()
    got, cached = complete(b, prompts[2], hint)
    assert got == want[2] and cached == 0
    assert time.monotonic() - t0 < 60
