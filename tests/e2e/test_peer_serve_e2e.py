"""Peers as an operator runs them: three `vllm serve` processes, one
`kvbm-pool` and the peer directory (a real ``redis-server``), all on
127.0.0.1, each reader on one of UCX's two kinds of transport:

- engine A keeps its pool in a file kvbm-pool holds and serves (pool_socket)
  and lists its pages in the directory;
- engine B reads peers on a router's hint (kv_transfer_params naming
  kvbm-pool's endpoint) over TCP, as between machines (``UCX_TLS=tcp,self``);
- engine C reads peers the directory names, without a hint, over UCX's
  default transports (on one machine shared memory: ``cma``).

UCX_PROTO_INFO prints the transport each reader's READs took: B's log must
name tcp, C's shared memory. Every hit equals the reader's own recompute of
the prompt (greedy). Then the faults, in order: A killed (kvbm-pool still
serves its pages); A restarted against the live kvbm-pool (attached at once,
its first request a pool hit); kvbm-pool killed and restarted while A runs
(A keeps serving; the new kvbm-pool takes the file up again, stale socket
and all, and serves what A wrote meanwhile); kvbm-pool killed for good (its
directory entries outlive its liveness key: C ignores them and recomputes
without asking it; B's hint costs a recompute in bounded time).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.engines import MODEL_DIR, RECOMPUTE, random_prompt
from helpers.system import shm_dir
from test_peer_directory_e2e import entries
from test_redis_e2e import password_file, redis_server  # noqa: F401 (fixtures)
from test_request_params_e2e import PAGE, SERVE_ARGS, Client
from vllm_kvbm.tiers.peer import directory as pd
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(1800)

TOKENS = 16
PAGES = 3  # full pages of each prompt
SERVE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
TCP = {"UCX_TLS": "tcp,self", "UCX_PROTO_INFO": "y"}
SHARED_MEMORY = {"UCX_PROTO_INFO": "y"}  # UCX's defaults: cma (or sysv/posix) on one machine
SHM_TRANSPORTS = {"cma", "sysv", "posix", "knem", "xpmem"}
PROMPTS = {
    name: random_prompt(PAGES * PAGE + 10, seed=9500 + i)
    for i, name in enumerate(
        ("hinted", "listed", "a_dead", "a_restarted", "pool_down", "holder_dead")
    )
}


def complete(
    client: Client, prompt: list[int], params: dict | None, reset: bool = True
) -> tuple[list[int], int]:
    """(greedy tokens, tokens cached) of a 16-token completion, vLLM's own
    prefix cache emptied first (``reset``)."""
    if reset:
        client.reset()
    body = {
        "model": client.server.model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(
        f"{client.server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    assert "kvbm_error" not in (out.get("kv_transfer_params") or {}), out
    choice = out["choices"][0]
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return choice["logprobs"]["tokens"], cached


def read_transports(log: Path) -> set[str]:
    """The UCX transports a server's READs took (ucp_get's protocol tables,
    which UCX_PROTO_INFO=y prints: 'tcp' for tcp/lo, 'cma' for cma/memory)."""
    lines = log.read_text(errors="replace").splitlines()
    found: set[str] = set()
    for i, line in enumerate(lines):
        if "remote memory read by ucp_get" not in line:
            continue
        borders = 0
        for row in lines[i + 1 : i + 20]:
            body = row.rsplit("]", 1)[-1].strip()
            if body.startswith("+"):
                borders += 1
                if borders == 3:  # the table's end
                    break
            cells = [c.strip() for c in body.split("|")]
            if body.startswith("|") and len(cells) > 3 and ".." in cells[1]:
                found.update(re.findall(r"([a-z0-9_]+)/[\w:.-]+", cells[3]))
    return found


def counted(client: Client, tier: str, tokens: int) -> bool:
    """Whether the server's kvbm_matched_tokens_total{tier} reaches ``tokens`` (within 20 s)."""
    return bool(
        wait_for(lambda: client.server.metric("kvbm_matched_tokens_total", tier=tier) == tokens, 20)
    )


def lines_with(log: Path, text: str) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if text in line]


def wait_for(what, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(every)
    return got


class KvbmPool:
    """kvbm-pool on 127.0.0.1 with the peer directory and UCX's default
    transports (each reader's own UCX_TLS decides how it reads), started
    again at the same socket and port after a kill."""

    def __init__(self, shm: str, directory_url: str, password_file: Path, logs: Path):
        self.shm, self.logs = shm, logs
        self.port, self.sock = free_port(), os.path.join(shm, "pool.sock")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.args = [
            "--dir",
            shm,
            "--socket",
            self.sock,
            "--serve-port",
            str(self.port),
            "--serve-host",
            "127.0.0.1",
            "--directory-url",
            directory_url,
            "--directory-password-file",
            str(password_file),
        ]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def check(self) -> bool:
        return (
            subprocess.run(
                [sys.executable, "-m", "vllm_kvbm.tools.pool", "--check", "--socket", self.sock],
                capture_output=True,
                timeout=60,
            ).returncode
            == 0
        )

    def start(self) -> None:
        self.starts += 1
        self.log = self.logs / f"kvbm-pool-{self.starts}.log"
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_kvbm.tools.pool", *self.args],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while not self.check():
            assert self.proc.poll() is None, f"kvbm-pool exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, "kvbm-pool did not start"
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def shm():
    with shm_dir("kvbm-e2e-peer-serve-") as d:
        yield d


@pytest.fixture(scope="module")
def pool(shm, redis_server, password_file, tmp_path_factory):  # noqa: F811
    service = KvbmPool(shm, redis_server.url, password_file, tmp_path_factory.mktemp("pool"))
    service.start()
    yield service
    service.kill()


class Fleet:
    """The three engines' clients; A started again on demand."""

    def __init__(
        self, stack: contextlib.ExitStack, logs: Path, shm: str, pool: KvbmPool, directory: dict
    ):
        self.stack, self.logs = stack, logs
        self.computed: dict[str, list] = {}  # A's tokens of the prompts it computed
        self.a_kv = kvbm_transfer_config(
            host_cache_blocks=6,
            pool_cache_size="192MiB",
            pool_dir=shm,
            pool_socket=pool.sock,
            load_split=False,
            **directory,
        )
        self.a = self.serve("a", self.a_kv, {})
        self.b = self.serve(
            "b",
            kvbm_transfer_config(
                host_cache_blocks=6, peer_reads=True, peer_read_timeout_s=5, load_split=False
            ),
            TCP,
        )
        self.c = self.serve(
            "c",
            kvbm_transfer_config(
                host_cache_blocks=6,
                peer_reads=True,
                peer_read_timeout_s=5,
                load_split=False,
                **directory,
            ),
            SHARED_MEMORY,
        )

    def serve(self, name: str, kv: dict, env: dict) -> Client:
        server = self.stack.enter_context(
            vllm_server(
                str(MODEL_DIR),
                kv,
                SERVE_ARGS,
                env={**SERVE_ENV, **env},
                startup_timeout=900,
                log_path=self.logs / f"{name}.log",
            )
        )
        return Client(server)

    def kill_a(self) -> None:
        os.killpg(self.a.server.process.pid, signal.SIGKILL)
        self.a.server.process.wait(60)


@pytest.fixture(scope="module")
def fleet(model_dir, shm, pool, redis_server, password_file, tmp_path_factory):  # noqa: F811
    directory = {
        "peer_directory_url": redis_server.url,
        "remote_password_file": str(password_file),
        "remote_timeout_s": 1.0,
    }
    with contextlib.ExitStack() as stack:
        yield Fleet(stack, tmp_path_factory.mktemp("logs"), shm, pool, directory)


@pytest.fixture(scope="module")
def want(fleet):
    """Each reader's own recompute of every prompt (nothing stored)."""
    return {
        reader: {
            name: complete(getattr(fleet, reader), p, RECOMPUTE)[0] for name, p in PROMPTS.items()
        }
        for reader in ("b", "c")
    }


def hint(pool: KvbmPool) -> dict:
    return {"router_hint": {"source_control_endpoint": pool.endpoint}}


def listed(redis_server, pool: KvbmPool, n: int) -> bool:  # noqa: F811
    """Whether at least ``n`` directory entries name kvbm-pool (within 20 s)."""
    return bool(wait_for(lambda: entries(redis_server).get(pool.endpoint, 0) >= n, 20))


def test_b_on_a_hint_over_tcp_and_c_through_the_directory_over_shm_read_as_recomputed(
    fleet, pool, want, redis_server
):  # noqa: F811
    for name in ("hinted", "listed", "a_dead", "a_restarted"):
        # A computes them: kvbm-pool's file has them
        fleet.computed[name] = complete(fleet.a, PROMPTS[name], None)[0]
    assert listed(redis_server, pool, 4 * PAGES)  # A listed them, naming kvbm-pool
    with redis_server.admin() as c:
        assert c.exists(pd.alive_key(pool.endpoint))  # which keeps its liveness

    got, cached = complete(fleet.b, PROMPTS["hinted"], hint(pool))
    assert got == want["b"]["hinted"] and cached == PAGES * PAGE
    got, cached = complete(fleet.c, PROMPTS["listed"], None)  # no hint: the directory
    assert got == want["c"]["listed"] and cached == PAGES * PAGE
    for client in (fleet.b, fleet.c):
        assert counted(client, "peer", PAGES * PAGE)
    assert read_transports(fleet.b.server.log_path) == {"tcp"}
    shm_used = read_transports(fleet.c.server.log_path)
    assert shm_used and shm_used <= SHM_TRANSPORTS, shm_used


def test_kvbm_pool_serves_a_dead_engines_pages_and_a_restarted_one_hits_at_once(fleet, pool, want):
    fleet.kill_a()  # kvbm-pool still holds its pages and serves them
    got, cached = complete(fleet.b, PROMPTS["a_dead"], hint(pool))
    assert got == want["b"]["a_dead"] and cached == PAGES * PAGE

    fleet.a = fleet.serve("a-again", fleet.a_kv, {})  # attaches to the same file
    log = fleet.a.server.log_path
    assert lines_with(log, f"attached to kvbm-pool at {pool.sock}")
    assert not lines_with(log, "cannot attach")
    got, cached = complete(fleet.a, PROMPTS["a_restarted"], None)  # its first request
    assert got == fleet.computed["a_restarted"] and cached == PAGES * PAGE
    assert counted(fleet.a, "pool", PAGES * PAGE)


def test_a_restarted_kvbm_pool_takes_the_file_up_and_serves_what_a_wrote_meanwhile(
    fleet, pool, want, redis_server
):  # noqa: F811
    assert fleet.a.server.metric("kvbm_tier_up", tier="pool") == 1  # attached, answered
    pool.kill()  # A still maps the file: it keeps serving, and writing into it
    assert os.path.exists(pool.sock)  # the dead one's socket, left behind
    # A's worker asks kvbm-pool every 5 s: it says the pool is gone, and its gauge reads 0
    log = fleet.a.server.log_path
    assert wait_for(lambda: lines_with(log, "stopped answering"), 20)
    got, cached = complete(fleet.a, PROMPTS["pool_down"], None)
    assert len(got) == TOKENS and cached == 0
    assert wait_for(lambda: fleet.a.server.metric("kvbm_tier_up", tier="pool") == 0, 20)
    pool.start()  # neither the stale socket nor the file refuses it
    assert lines_with(pool.log, "took up 1 pool file(s)")
    assert wait_for(lambda: lines_with(log, "answers again"), 20)
    with redis_server.admin() as c:
        assert wait_for(lambda: c.exists(pd.alive_key(pool.endpoint)), 10)
    got, cached = complete(fleet.b, PROMPTS["pool_down"], hint(pool))
    assert got == want["b"]["pool_down"] and cached == PAGES * PAGE


def test_a_dead_holders_entries_are_ignored_and_its_hint_costs_a_recompute(
    fleet, pool, want, redis_server
):  # noqa: F811
    before = entries(redis_server).get(pool.endpoint, 0)
    complete(fleet.a, PROMPTS["holder_dead"], None)
    assert listed(redis_server, pool, before + PAGES)
    pool.kill()  # a crash: its entries stay (their TTL), its liveness key expires
    with redis_server.admin() as c:
        assert wait_for(lambda: not c.exists(pd.alive_key(pool.endpoint)), 15)
    assert entries(redis_server).get(pool.endpoint, 0) >= before + PAGES

    t0 = time.monotonic()
    got, cached = complete(fleet.c, PROMPTS["holder_dead"], None)
    assert got == want["c"]["holder_dead"] and cached == 0
    assert time.monotonic() - t0 < 30
    # C never asked the dead holder (B, named it by a hint, does: the line's shape)
    asked = f"peer {pool.endpoint} did not answer a lookup"
    assert not lines_with(fleet.c.server.log_path, asked)

    t0 = time.monotonic()
    got, cached = complete(fleet.b, PROMPTS["holder_dead"], hint(pool))
    assert got == want["b"]["holder_dead"] and cached == 0
    assert time.monotonic() - t0 < 60
    assert wait_for(lambda: lines_with(fleet.b.server.log_path, asked), 10)
