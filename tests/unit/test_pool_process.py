"""kvbm-pool in a real process: engines (processes of their own,
helpers/pool_engine.py) attach over its Unix socket and write into the file
it holds; it keeps the pages and serves them to peers (a real PeerStore with
NIXL) after the engine is killed, takes its files up again after its own
restart, and an engine that cannot attach keeps a pool file of its own, said
in one log line."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib

import pytest
import torch

from helpers import ROOT, pool_engine, pool_peer
from helpers.tier_pages import key, page
from vllm_kvbm.config import KVBMConfigError, load_config
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.peer.store import PeerStore
from vllm_kvbm.tiers.pool.attach import open_engine_pool
from vllm_kvbm.tiers.pool.pool_file import PoolSpec
from vllm_kvbm.tiers.pool import watch
from vllm_kvbm.tiers.pool.store import PoolStore
from vllm_kvbm.tools.server import free_port

pytestmark = pytest.mark.timeout(300)

PAGE = 256 * 1024
CAPACITY = 8 << 20  # about 30 pages
NS, SECRET = pool_engine.NS, pool_engine.SECRET


def start_pool(shm: str, serve_port: int | None, procs: list, timeout: float = 60.0):
    sock = os.path.join(shm, "run", "pool.sock")
    cmd = [
        sys.executable,
        "-m",
        "vllm_kvbm.tools.pool",
        "--dir",
        shm,
        "--socket",
        sock,
        "--serve-host",
        "127.0.0.1",
    ]
    if serve_port is not None:
        cmd += ["--serve-port", str(serve_port)]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "UCX_TLS": "tcp"},
    )
    procs.append(proc)
    deadline = time.monotonic() + timeout
    while check(sock) != 0:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "kvbm-pool never answered"
        time.sleep(0.2)
    return proc, sock


def check(sock: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "vllm_kvbm.tools.pool", "--check", "--socket", sock],
        capture_output=True,
        timeout=60,
    ).returncode


def reader() -> PeerStore:
    spec = pool_peer.pool_spec("/nonexistent", PAGE, 1, NS)
    return PeerStore(
        PageCodec(NS, PAGE, SECRET, layout="L"),
        0,
        1,
        spec.scope_digest,
        spec.name,
        read_timeout_s=2.0,
        retry_s=0.3,
        hello_every_s=0.2,
    )


def read_all(store: PeerStore, endpoint: str, n: int, timeout: float = 20.0) -> bool:
    """Whether pages 1..n read back intact from ``endpoint`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    outs = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(n)]
    while time.monotonic() < deadline:
        got = store.get_many_into(
            [(key(i), o) for i, o in zip(range(1, n + 1), outs)], endpoint=endpoint
        )
        if got == ["ok"] * n:
            return all(torch.equal(o, page(i, PAGE)) for i, o in zip(range(1, n + 1), outs))
        time.sleep(0.2)
    return False


def test_pages_outlive_the_engine_and_the_pool_restarts_serving_them(shm, procs, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    pool, sock = start_pool(shm, port, procs)
    engine, line = pool_engine.start(shm, sock, PAGE, 5, CAPACITY, env={"UCX_TLS": "tcp"})
    procs.append(engine)
    path, how = line.split()
    assert how == "attached" and os.path.dirname(path) == shm
    r = reader()
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        assert read_all(r, endpoint, 5)  # kvbm-pool serves what the engine wrote
        os.killpg(engine.pid, signal.SIGKILL)  # the engine crashes
        engine.wait(10)
        assert read_all(r, endpoint, 5)  # its pages are still served
        # an engine started again attaches to the same file and finds them at once
        again, line = pool_engine.start(shm, sock, PAGE, 0, CAPACITY, env={"UCX_TLS": "tcp"})
        procs.append(again)
        assert line.split() == [path, "attached"]
        spec = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "L", CAPACITY)
        config = load_config(
            {"pool_cache_size": CAPACITY, "pool_dir": shm, "pool_socket": sock}, environ={}
        )
        mapped, server = open_engine_pool(config, spec, 0)  # a third attach, in this process
        local = PoolStore(mapped, PageCodec(NS, PAGE, SECRET, layout="L"), server)
        try:
            out = torch.zeros(PAGE, dtype=torch.uint8)
            assert server is None and local.get_into(key(3), out) == "ok"
            assert torch.equal(out, page(3, PAGE))
        finally:
            local.close()
        # kvbm-pool itself restarts: it takes the file up again and serves it
        os.killpg(pool.pid, signal.SIGKILL)
        pool.wait(10)
        restarted, _ = start_pool(shm, port, procs)
        assert read_all(r, endpoint, 5)
        assert r._peers[endpoint].incarnation  # a new incarnation, loaded
    finally:
        r.close()


def attached_store(shm: str, sock: str) -> PoolStore:
    """This process attached to kvbm-pool as an engine's worker: the writer of its file."""
    spec = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "L", CAPACITY)
    config = load_config(
        {"pool_cache_size": CAPACITY, "pool_dir": shm, "pool_socket": sock}, environ={}
    )
    mapped, server = open_engine_pool(config, spec, 0)
    assert server is None  # attached: kvbm-pool serves it
    return PoolStore(mapped, PageCodec(NS, PAGE, SECRET, layout="L"), server)


def test_a_page_evicted_between_a_peers_lookup_and_its_read_is_a_miss_never_another(
    shm, procs, monkeypatch
):
    """kvbm-pool serves the file; the engine's writes evict a page a peer's
    lookup found, before and while the peer reads it: each read is a miss or
    that page, verified, never the page that took its slot."""
    import random
    import threading

    monkeypatch.setenv("UCX_TLS", "tcp")
    port = free_port()
    _, sock = start_pool(shm, port, procs)
    w = attached_store(shm, sock)
    r = reader()
    endpoint = f"tcp://127.0.0.1:{port}"
    out = torch.zeros(PAGE, dtype=torch.uint8)
    fresh = iter(range(2, 1 << 30))

    def evict_page_1() -> int:
        """Pages written until page 1's slot is taken: how many."""
        n = 0
        while w.contains(key(1)):
            i = next(fresh)
            assert w.put(key(i), page(i, PAGE))
            n += 1
        return n

    try:
        assert w.put(key(1), page(1, PAGE))
        assert read_all(r, endpoint, 1)  # connected
        assert r.lookup(endpoint, [key(1)]) == [True]  # a scheduler's lookup: held
        assert evict_page_1() > 0
        assert r.get_many_into([(key(1), out)], endpoint=endpoint) == ["miss"]
        # and while it reads: page 1 written and evicted again and again
        stop = threading.Event()

        def churn():
            # paced at random: some reads find page 1, some its slot taken, some
            # fall across its eviction
            rng = random.Random(0)
            while not stop.is_set():
                assert w.put(key(1), page(1, PAGE))
                time.sleep(rng.uniform(0, 0.02))
                evict_page_1()
                time.sleep(rng.uniform(0, 0.02))

        thread = threading.Thread(target=churn, daemon=True)
        thread.start()
        counts = {"ok": 0, "miss": 0}
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline and min(counts.values()) < 3:
                out.zero_()
                (status,) = r.get_many_into([(key(1), out)], endpoint=endpoint)
                assert status in counts, status
                counts[status] += 1
                if status == "ok":
                    assert torch.equal(out, page(1, PAGE))
        finally:
            stop.set()
            thread.join(10)
        assert min(counts.values()) >= 1, counts
    finally:
        r.close()
        w.close()


def test_an_attached_engine_says_when_kvbm_pool_is_gone_and_when_it_is_back(
    shm, procs, monkeypatch, caplog
):
    """kvbm-pool SIGKILLed under an attached worker: one warning (its pages
    stay in the file it keeps writing); the pool restarted: the worker
    attaches again and says so; its watch ends with the file."""
    monkeypatch.setattr(watch, "WATCH_EVERY_S", 0.2)
    caplog.set_level(logging.INFO, logger="vllm_kvbm")
    pool, sock = start_pool(shm, None, procs)
    store = attached_store(shm, sock)
    w = store.pool.watch
    try:
        assert w is not None and w.answering
        os.killpg(pool.pid, signal.SIGKILL)
        pool.wait(10)
        assert store.counts()["up"] == 1  # kvbm_tier_up{tier="pool"}
        _until(lambda: not w.answering, 20, "the loss of kvbm-pool noticed")
        assert store.counts()["up"] == 0
        [gone] = [r for r in caplog.records if "stopped answering" in r.getMessage()]
        assert gone.levelno == logging.WARNING and store.pool.path in gone.getMessage()
        assert store.put(key(2), page(2, PAGE))  # the engine's own tier goes on
        start_pool(shm, None, procs)
        _until(lambda: w.answering, 30, "kvbm-pool's return noticed")
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert w.lost == 1 and store.counts()["up"] == 1
        out = torch.zeros(PAGE, dtype=torch.uint8)
        assert store.get_into(key(2), out) == "ok" and torch.equal(out, page(2, PAGE))
    finally:
        store.close()
    assert not w._thread.is_alive()


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_an_engine_that_cannot_attach_keeps_its_own_file_in_one_line(shm, caplog):
    sock = os.path.join(shm, "nobody-listens.sock")
    spec = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "L", CAPACITY)
    config = load_config(
        {"pool_cache_size": CAPACITY, "pool_dir": shm, "pool_socket": sock}, environ={}
    )
    with caplog.at_level(logging.INFO, logger="vllm_kvbm"):
        pool, server = open_engine_pool(config, spec, 0)
    try:
        lines = [r for r in caplog.records if r.name.startswith("vllm_kvbm.tiers.pool")]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
        message = lines[0].getMessage()
        assert "cannot attach to kvbm-pool at " + sock in message
        assert "keeps its own pool file " + spec.path in message
        assert server is None and pool.path == spec.path
    finally:
        pool.close()


def test_a_refused_engine_serves_its_own_file_and_another_layout_is_an_error(
    shm, procs, monkeypatch
):
    monkeypatch.setenv("UCX_TLS", "tcp")
    _, sock = start_pool(shm, None, procs)
    first, line = pool_engine.start(shm, sock, PAGE, 2, CAPACITY, env={"UCX_TLS": "tcp"})
    procs.append(first)
    assert line.endswith("attached")
    # another KV layout, same name: kvbm-pool refuses it, and the file it
    # holds cannot be taken over either: an error naming pool_dir
    spec = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "other layout", CAPACITY)
    config = load_config(
        {"pool_cache_size": CAPACITY, "pool_dir": shm, "pool_socket": sock}, environ={}
    )
    with pytest.raises(KVBMConfigError, match="pool_dir: .* in use"):
        open_engine_pool(config, spec, 0)
    # kvbm-pool in another directory: refused, so the engine keeps its own
    # file in its pool_dir and serves it itself
    other = tempfile.mkdtemp(prefix="kvbm-test-poolproc-own-", dir="/dev/shm")
    try:
        port = free_port()
        own, line = pool_engine.start(
            other, sock, PAGE, 3, CAPACITY, serve_port=port, env={"UCX_TLS": "tcp"}
        )
        procs.append(own)
        path, how = line.split()
        assert how == "own" and os.path.dirname(path) == other
        r = reader()
        try:
            assert read_all(r, f"tcp://127.0.0.1:{port}", 3)
        finally:
            r.close()
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_the_command_line_checks_and_refuses_a_second_pool(shm, procs):
    sock = os.path.join(shm, "run", "pool.sock")
    assert check(sock) == 1  # nothing listens
    start_pool(shm, None, procs)
    second = subprocess.run(
        [sys.executable, "-m", "vllm_kvbm.tools.pool", "--dir", shm, "--socket", sock],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2 and "another kvbm-pool listens" in second.stderr
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"


def test_kvbm_pool_is_a_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvbm-pool"] == "vllm_kvbm.tools.pool:main"
    from vllm_kvbm.tools.pool import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


def test_the_systemd_unit_runs_kvbm_pool_where_engines_look(tmp_path):
    """deploy/kvbm-pool.service: systemd-analyze accepts it (its ExecStart
    pointed at a stand-in binary), and it runs kvbm-pool on /dev/shm with the
    socket in its runtime directory."""
    import shlex
    import shutil as sh

    text = (ROOT / "deploy" / "kvbm-pool.service").read_text()
    exec_start = " ".join(
        line.strip().rstrip("\\") for line in text.split("ExecStart=", 1)[1].split("\n")[:2]
    )
    args = shlex.split(exec_start)
    assert args[0].endswith("/kvbm-pool")
    assert args[args.index("--dir") + 1] == "/dev/shm"
    assert args[args.index("--socket") + 1] == "/run/kvbm/pool.sock"
    assert "RuntimeDirectory=kvbm" in text and "RuntimeDirectoryMode=0700" in text
    from vllm_kvbm.tools.pool import main

    with pytest.raises(SystemExit) as done:  # its arguments parse
        main([*args[1:], "--help"])
    assert done.value.code == 0
    analyze = sh.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    stand_in = tmp_path / "kvbm-pool"
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    unit = tmp_path / "kvbm-pool.service"
    unit.write_text(text.replace(args[0], str(stand_in)))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_a_serve_port_in_use_costs_peers_not_the_engine(shm, caplog):
    """pool_serve_port taken by another process: one warning, the engine keeps
    its pool (peers cannot read it)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        spec = PoolSpec.for_worker(shm, NS, PAGE, 0, 1, "L", CAPACITY)
        config = load_config(
            {
                "pool_cache_size": CAPACITY,
                "pool_dir": shm,
                "pool_serve_port": port,
                "pool_serve_host": "127.0.0.1",
            },
            environ={},
        )
        with caplog.at_level(logging.WARNING, logger="vllm_kvbm"):
            pool, server = open_engine_pool(config, spec, 0)
        try:
            assert server is None and pool.path == spec.path
            [line] = [
                r.getMessage() for r in caplog.records if r.name.startswith("vllm_kvbm.tiers.pool")
            ]
            assert f"cannot serve {spec.path} to peers on 127.0.0.1:{port}" in line
        finally:
            pool.close()
