"""The remote tier on Redis (RedisStore, RedisView) when its server fails, for
real: killed, frozen (SIGSTOP), unreachable at startup, and a cluster node
killed. Calls wait at most their timeouts, then miss at once until the
background reconnect finds the server again.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from helpers.tier_pages import SMALL, key, page
from test_redis_store import PASSWORD, WRONG, RedisServer, _cluster_port, timed, wait_until
from test_redis_store import _no_password_in_logs, server, stores  # noqa: F401 (fixtures)
from test_redis_store import pytestmark  # noqa: F401 (the same marks: redis-server, timeouts)
from vllm_kvbm.config import KVBMConfigError


# ---- a dead or frozen server ----------------------------------------------------


def test_killed_server_costs_hits_within_the_timeout_then_recovers(tmp_path, stores, caplog):
    srv = RedisServer(tmp_path).start()
    timeout = 1.0
    try:
        s = stores(srv, timeout_s=timeout, retry=0.3)
        v = stores(srv, timeout_s=timeout, retry=0.3, view=True)
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert s.put(key(1), page(1, SMALL)) and v.contains(key(1))
        srv.kill()
        seen = [
            timed(lambda: s.get_into(key(1), out)),
            timed(lambda: v.contains(key(1))),
            timed(lambda: s.put(key(2), page(2, SMALL))),
            timed(lambda: s.contains(key(1))),
        ]
        assert [r for r, _ in seen] == ["error", False, False, False], seen
        assert all(dt < timeout + 0.5 for _, dt in seen), seen
        assert "unavailable" in caplog.text
        # Further calls fail at once: nobody waits on the reconnects.
        for _ in range(5):
            r, dt = timed(lambda: s.get_into(key(1), out))
            assert r == "error" and dt < 0.05, dt
            time.sleep(0.1)
        srv.start()  # same port, an empty server
        assert wait_until(lambda: s.put(key(3), page(3, SMALL)), timeout=10)
        assert wait_until(lambda: v.contains(key(3)), timeout=10)
        assert s.get_into(key(3), out) == "ok" and torch.equal(out, page(3, SMALL))
        assert s.get_into(key(1), out) == "miss"  # the old server's pages died with it
        assert "reachable again" in caplog.text
    finally:
        srv.kill()


def test_frozen_server_is_bounded_then_recovers(server, stores):
    timeout = 1.0
    s = stores(server, timeout_s=timeout, retry=0.3)
    v = stores(server, timeout_s=timeout, retry=0.3, view=True)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert s.put(key(1), page(1, SMALL))
    server.freeze()
    try:
        first = [timed(lambda: s.get_into(key(1), out)), timed(lambda: v.contains(key(1)))]
        assert [r for r, _ in first] == ["error", False], first
        # Each waited on the frozen server, and no longer than its timeouts.
        assert all(timeout * 0.8 < dt < 2 * timeout + 0.5 for _, dt in first), first
        later = []
        for _ in range(6):  # the reconnects run in the background
            later += [
                timed(lambda: s.contains(key(1))),
                timed(lambda: v.contains(key(1))),
                timed(lambda: s.put(key(2), page(2, SMALL))),
            ]
            time.sleep(0.2)
        assert all(r is False and dt < 0.05 for r, dt in later), later
    finally:
        server.thaw()
    assert wait_until(lambda: s.get_into(key(1), out) == "ok", timeout=10)
    assert torch.equal(out, page(1, SMALL))  # frozen, not lost
    assert wait_until(lambda: v.contains(key(1)), timeout=10)


def test_unreachable_at_startup_then_the_server_appears(tmp_path, stores):
    srv = RedisServer(tmp_path)
    t0 = time.monotonic()
    s = stores(url=srv.url, timeout_s=1.0, retry=0.3)
    v = stores(url=srv.url, timeout_s=1.0, retry=0.3, view=True)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert not s.put(key(1), page(1, SMALL)) and s.get_into(key(1), out) == "error"
    assert not v.contains(key(1))
    assert time.monotonic() - t0 < 1.0
    try:
        srv.start()
        assert wait_until(lambda: s.put(key(1), page(1, SMALL)), timeout=10)
        assert wait_until(lambda: v.contains(key(1)), timeout=10)
    finally:
        srv.kill()


# ---- a Redis Cluster -------------------------------------------------------------


def test_cluster_spreads_pages_and_survives_a_dead_node(tmp_path, stores):
    nodes = []
    try:
        for i in range(3):
            d = tmp_path / f"node{i}"
            d.mkdir()
            nodes.append(
                RedisServer(
                    d,
                    PASSWORD,
                    "16mb",
                    "allkeys-lru",
                    "--cluster-enabled",
                    "yes",
                    "--masterauth",
                    PASSWORD,
                    "--cluster-config-file",
                    str(d / "nodes.conf"),
                    port=_cluster_port(),
                ).start()
            )
        r = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            env={**os.environ, "REDISCLI_AUTH": PASSWORD},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

        def cluster_ok():
            states = []
            for n in nodes:
                with n.admin() as c:
                    states.append(c.cluster("info")["cluster_state"])
            return states == ["ok"] * len(nodes)

        assert wait_until(cluster_ok, timeout=30, step=0.2)

        url = f"redis+cluster://127.0.0.1:{nodes[0].port}"  # one seed node finds the rest
        s = stores(url=url, timeout_s=1.0, retry=0.3)
        v = stores(url=url, timeout_s=1.0, retry=0.3, view=True)
        out = torch.empty(SMALL, dtype=torch.uint8)
        keys = [key(i) for i in range(30)]
        assert all(s.put(k, page(i, SMALL)) for i, k in enumerate(keys))
        sizes = []
        for n in nodes:
            with n.admin() as c:
                sizes.append(c.dbsize())
        assert sum(sizes) == 30 and sum(1 for x in sizes if x) >= 2, sizes
        assert v.contains_many(keys) == [True] * 30
        assert all(
            s.get_into(k, out) == "ok" and torch.equal(out, page(i, SMALL))
            for i, k in enumerate(keys)
        )
        with pytest.raises(KVBMConfigError, match="remote_password_file"):
            stores(url=url, password=WRONG)

        nodes[2].kill()
        results = [timed(lambda k=k: s.get_into(k, out)) for k in keys]
        assert {r for r, _ in results} <= {"ok", "error"}, results
        assert "error" in {r for r, _ in results}
        assert all(dt < 2 * 1.0 + 0.5 for _, dt in results), results
        assert sum(dt for _, dt in results) < 10
        looked, dt = timed(lambda: v.contains_many(keys))
        assert dt < 2 * 1.0 + 0.5 and not all(looked)
    finally:
        for n in nodes:
            n.kill()
