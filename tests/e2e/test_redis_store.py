"""The remote tier on Redis (RedisStore, RedisView) against real ``redis-server``s
(Debian's, installed by scripts/setup_tools.sh) with a password; faults are
produced for real: a full LRU server, flipped bytes (test_redis_auth.py: passwords,
page secrets, TLS; test_redis_outages.py: killed, frozen and unreachable servers).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import time

import pytest
import redis
import torch

from helpers.system import stop_every_thread
from helpers.tier_pages import SMALL, key, page
from vllm_kvbm.config import KVBMConfigError, load_config, parse_remote_url
from vllm_kvbm.config.secrets import Secret
from vllm_kvbm.tiers.redis.view import RedisView
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tiers.page_names import page_name
from vllm_kvbm.tiers.redis.store import RedisStore

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.timing,  # frozen and killed servers are timed against their timeouts
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="redis-server not installed (scripts/setup_tools.sh installs it)",
    ),
]

PASSWORD = "kvbm-T3st-pässword/with:odd@chars"
WRONG = "not-the-Right-0ne"
NS = "ns-redis"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(200):
        port = random.randrange(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """A real redis-server on 127.0.0.1 with requirepass; always killed."""

    def __init__(
        self,
        workdir,
        password: str = PASSWORD,
        maxmemory: str = "8mb",
        policy: str = "allkeys-lru",
        *extra: str,
        port: int | None = None,
    ):
        self.port = port or _free_port()
        self.password = password
        self.dir = str(workdir)
        self.args = [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            password,
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            policy,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--daemonize",
            "no",
            "--logfile",
            os.path.join(self.dir, f"redis-{self.port}.log"),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait_ready()
        return self

    def admin(self) -> redis.Redis:
        return redis.Redis("127.0.0.1", self.port, password=self.password, socket_timeout=5)

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with self.admin() as c:
                    if c.ping():
                        return
            except redis.RedisError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server not answering after {timeout}s")

    def freeze(self) -> None:
        stop_every_thread(self.proc, "redis-server")

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def stores():
    made = []

    def make(
        srv=None,
        *,
        url=None,
        password=PASSWORD,
        ns=NS,
        block=SMALL,
        rank=0,
        world=1,
        timeout_s=1.0,
        retry=0.3,
        view=False,
        ca=None,
        secret=None,
    ):
        target = url or srv.url
        pw = None if password is None else Secret(password, "remote_password_file f")
        if view:
            s = RedisView(target, pw, ns, block, world, timeout_s, retry, tls_ca_file=ca)
        else:
            s = RedisStore(
                parse_remote_url("remote_url", target),
                pw,
                block,
                ns,
                rank,
                world,
                timeout_s,
                retry_interval_s=retry,
                tls_ca_file=ca,
                page_secret=secret,
            )
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def _no_password_in_logs(caplog):
    """Whatever a test does, neither password reaches a log record."""
    caplog.set_level(logging.DEBUG)
    yield
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert PASSWORD not in text and WRONG not in text


def wait_until(cond, timeout: float = 10.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def timed(fn):
    t0 = time.monotonic()
    r = fn()
    return r, time.monotonic() - t0


# ---- the page on the server --------------------------------------------------


def test_round_trip_one_key_per_page_and_remove(server, stores):
    s = stores(server)
    src = page(1, SMALL)
    want = src.clone()
    assert s.put(key(1), src)
    src.fill_(7)  # put copied it
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.contains(key(1)) and not s.contains(key(2))
    assert s.contains_many([key(1), key(2), b"short", key(1)]) == [True, False, False, True]
    assert s.get_into(key(1), out) == "ok" and torch.equal(out, want)
    assert s.get_into(key(2), out) == "miss"
    # One key per page, named by page_name(), holding header + payload.
    name = page_name(NS, SMALL, 0, 1, key(1))
    with server.admin() as c:
        assert c.keys("*") == [name.encode()]
        assert c.strlen(name) == HEADER_BYTES + SMALL
    # Another namespace (model, dtype, ...) never sees it; another process does.
    assert stores(server, ns="other").get_into(key(1), out) == "miss"
    assert stores(server).get_into(key(1), out) == "ok" and torch.equal(out, want)
    s.remove(key(1))
    assert not s.contains(key(1)) and s.get_into(key(1), out) == "miss"
    # Bad arguments are refusals, not exceptions.
    assert (
        not s.put(b"short", want)
        and s.get_into(key(1), torch.empty(3, dtype=torch.uint8)) == "error"
    )


def test_flipped_byte_foreign_and_truncated_values_are_corrupt_and_removed(server, stores):
    s = stores(server)
    out = torch.empty(SMALL, dtype=torch.uint8)
    with server.admin() as c:
        for i, damage in enumerate(("flip", "foreign", "truncated", "moved")):
            k = key(10 + i)
            name = page_name(NS, SMALL, 0, 1, k)
            assert s.put(k, page(i, SMALL))
            if damage == "flip":
                offset = HEADER_BYTES + SMALL // 2
                byte = c.getrange(name, offset, offset)[0]
                c.setrange(name, offset, bytes([byte ^ 0x01]))
            elif damage == "foreign":
                c.set(name, b"not a page")
            elif damage == "truncated":
                c.set(name, c.getrange(name, 0, HEADER_BYTES + 99))
            else:  # another key's page filed under this name
                assert s.put(key(99), page(99, SMALL))
                c.set(name, c.get(page_name(NS, SMALL, 0, 1, key(99))))
            assert s.get_into(k, out) == "corrupt", damage
            assert c.exists(name) == 0, damage
            assert s.get_into(k, out) == "miss", damage
    assert s.get_into(key(99), out) == "ok" and torch.equal(out, page(99, SMALL))


def test_lru_server_stays_bounded_and_recent_pages_hit(server, stores, caplog):
    """maxmemory 8 MiB, allkeys-lru: ten times that written keeps memory
    bounded; the most recent pages all hit, the oldest are gone."""
    s = stores(server)
    with server.admin() as c:
        maxmemory = int(c.config_get("maxmemory")["maxmemory"])
    n = 10 * maxmemory // SMALL
    peak = 0
    for i in range(n):
        assert s.put(key(i), page(i % 64, SMALL)), i
        if i % 100 == 0:
            with server.admin() as c:
                peak = max(peak, c.info("memory")["used_memory"])
    with server.admin() as c:
        used = c.info("memory")["used_memory"]
        evicted = c.info("stats")["evicted_keys"]
        held = c.dbsize()
    peak = max(peak, used)
    assert peak <= maxmemory + 2 * SMALL, (peak, maxmemory)
    assert evicted >= n - held and held < n // 5, (evicted, held, n)
    # Redis's LRU is approximate (it samples keys), so a few recent pages may
    # go too; every page read back is whole and right, the oldest are gone.
    out = torch.empty(SMALL, dtype=torch.uint8)
    recent = [
        s.get_into(key(i), out) == "ok" and torch.equal(out, page(i % 64, SMALL))
        for i in range(n - 20, n)
    ]
    assert sum(recent) >= 16, recent
    assert all(s.get_into(key(i), out) in ("ok", "miss") for i in range(n - 200, n))
    assert [s.get_into(key(i), out) for i in range(100)] == ["miss"] * 100
    assert "maxmemory-policy" not in caplog.text  # allkeys-lru: no warning


def test_noeviction_server_refuses_pages_when_full_and_stays_usable(tmp_path, stores, caplog):
    srv = RedisServer(tmp_path, PASSWORD, "2mb", "noeviction").start()
    try:
        s = stores(srv)
        assert "maxmemory-policy noeviction" in caplog.text  # told at startup
        results = [s.put(key(i), page(i, SMALL)) for i in range(64)]
        assert results[0] and not results[-1]  # OOM replies: refused, not a crash
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert s.get_into(key(0), out) == "ok" and torch.equal(out, page(0, SMALL))
        assert s.contains(key(0))  # the link stayed up
    finally:
        srv.kill()


# ---- the scheduler's view ------------------------------------------------------


def test_view_needs_every_ranks_page(server, stores):
    block = 4096
    r0 = stores(server, block=block, rank=0, world=2)
    r1 = stores(server, block=block, rank=1, world=2)
    v = stores(server, block=block, world=2, view=True)
    assert r0.put(key(1), page(1, block)) and r0.put(key(2), page(2, block))
    assert r1.put(key(2), page(3, block))
    assert v.contains_many([key(1), key(2), key(3)]) == [False, True, False]
    assert not v.contains(key(1)) and v.contains(key(2))


# ---- config ------------------------------------------------------------------------


def test_password_in_the_url_is_refused_and_never_echoed():
    for url in (
        f"redis://:{WRONG}@127.0.0.1:6379",
        f"rediss://kvbm:{WRONG}@h:1/2",
        f"redis+cluster://kvbm:{WRONG}@a:1,b:2",
    ):
        with pytest.raises(KVBMConfigError) as info:
            load_config({"remote_url": url}, environ={})
        msg = str(info.value)
        assert msg.startswith("remote_url: ") and "remote_password_file" in msg, msg
        assert "KVBM_REMOTE_PASSWORD" in msg and WRONG not in msg, msg
    with pytest.raises(KVBMConfigError) as info:
        load_config({"remote_url": f"redis://h:1?password={WRONG}"}, environ={})
    assert WRONG not in str(info.value)
    with pytest.raises(KVBMConfigError, match="KVBM_REMOTE_PASSWORD: .* LMCache server"):
        load_config({"remote_url": "lm://h:1"}, environ={"KVBM_REMOTE_PASSWORD": WRONG})


def test_scheduler_process_with_a_redis_tier_loads_neither_lmcache_nor_nixl(server, tmp_path):
    import sys
    from pathlib import Path

    pw_file, wrong_file = tmp_path / "pw", tmp_path / "wrong"
    pw_file.write_text(PASSWORD)
    wrong_file.write_text(WRONG)
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from helpers.scheduler_harness import make_scheduler
s = make_scheduler(remote_url={server.url!r}, remote_password_file={str(pw_file)!r})
assert s.connector.sched is not None
from vllm_kvbm.config import KVBMConfigError
try:
    make_scheduler(remote_url={server.url!r}, remote_password_file={str(wrong_file)!r})
    print("STARTED WITH A WRONG PASSWORD")
except KVBMConfigError as e:
    print("REFUSED:", e)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("lmcache", "nixl", "nixl_cu12",
                                                           "nixl_cu13", "redis")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "redis" in loaded  # the view is real
    assert not [m for m in loaded if m.startswith(("lmcache", "nixl"))], loaded
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED: ")]
    assert refused and refused[0].startswith(f"REFUSED: remote_password_file: {server.url}"), (
        out.stdout[-2000:]
    )
    assert PASSWORD not in out.stdout + out.stderr and WRONG not in out.stdout + out.stderr
