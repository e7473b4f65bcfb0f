"""The compose stack's Redis command, run for real: the script docker-compose.yml
gives the redis service (as `docker compose config` resolves it, with .env.example's
values) starts a real redis-server (scripts/setup_tools.sh installs it) with the
password from its secret file, maxmemory and allkeys-lru; its healthcheck passes
only with that password, the password is on no command line, and the connector's
remote tier, given the same file, stores and finds a page. No Docker engine runs
here: the image's entrypoint is stood in for by one that starts its arguments,
on a free port of 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from helpers.compose import resolved
from vllm_kvbm.tools.server import free_port

pytestmark = pytest.mark.timeout(120)

SECRET = "/run/secrets/redis_password"


def as_run(text: str, password_file: Path) -> str:
    """A string of the resolved file as the container gets it ($$ is compose's
    escape of $), the secret at its path on this machine."""
    return text.replace("$$", "$").replace(SECRET, str(password_file))


@pytest.fixture
def stack_redis(tmp_path):
    """The redis service's command, ready to start: yields (port, password file,
    start(password=None) -> the process, the resolved service)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_tools.sh")
    service = resolved()["services"]["redis"]
    port = free_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The image's docker-entrypoint.sh drops to the redis user and execs its
    # arguments; here it execs them on a free loopback port, in tmp_path.
    entrypoint = bin_dir / "docker-entrypoint.sh"
    entrypoint.write_text(f'#!/bin/sh\nexec "$@" --port {port} --bind 127.0.0.1 --dir {tmp_path}\n')
    entrypoint.chmod(0o755)
    password_file = tmp_path / "redis_password"
    password_file.write_text("0123456789abcdef" * 4)
    command = [as_run(part, password_file) for part in service["command"]]
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    started = []

    def start(password: str | None = None) -> subprocess.Popen:
        if password is not None:
            password_file.write_text(password)
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started.append(proc)
        return proc

    try:
        yield port, password_file, start, service
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)


def wait_until_up(port: int, password: str, proc) -> redis.Redis:
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis did not start: {proc.stdout.read()}") from None
            time.sleep(0.1)


def test_the_stack_redis_needs_its_password_and_is_bounded(stack_redis):
    port, password_file, start, service = stack_redis
    proc = start()
    password = password_file.read_text()
    client = wait_until_up(port, password, proc)
    config = client.config_get("*")
    assert config["maxmemory"] == str(4 * 1024**3)  # .env.example's REDIS_MAXMEMORY, 4gb
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert config["save"] == "" and config["appendonly"] == "no"
    assert config["requirepass"] == password
    # without the password, or with another, nothing is served
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).get("x")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, password="wrong", socket_timeout=5).ping()
    # the password is on no command line: neither the shell's nor redis-server's
    pids = [
        proc.pid,
        *map(
            int,
            subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split(),
        ),
    ]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert password not in cmdline, pid

    # the healthcheck, as the container runs it, passes with the file and fails without it
    check = as_run(service["healthcheck"]["test"][1], password_file).replace(
        "redis-cli ", f"redis-cli -p {port} "
    )
    assert subprocess.run(["sh", "-c", check], timeout=30).returncode == 0
    password_file.write_text("wrong")
    assert subprocess.run(["sh", "-c", check], timeout=30).returncode != 0
    password_file.write_text(password)

    # the connector, given the same file as compose gives it, stores and finds a page
    import torch

    from vllm_kvbm.config import load_config, parse_remote_url
    from vllm_kvbm.tiers.redis.store import RedisStore

    cfg = load_config(
        {},
        environ={
            "KVBM_REMOTE_URL": f"redis://127.0.0.1:{port}",
            "KVBM_REMOTE_PASSWORD_FILE": str(password_file),
        },
    )
    store = RedisStore(
        parse_remote_url("remote_url", cfg.remote_url),
        cfg.remote_password,
        4096,
        "compose-test",
        0,
        1,
    )
    try:
        page = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
        key = bytes(range(32))
        assert store.put(key, page)
        out = torch.empty(4096, dtype=torch.uint8)
        assert store.get_into(key, out) == "ok" and torch.equal(out, page)
    finally:
        store.close()


def test_the_stack_redis_stops_on_an_empty_password_file(stack_redis):
    port, password_file, start, _ = stack_redis
    proc = start(password="")
    assert proc.wait(timeout=20) != 0
    out = proc.stdout.read()
    assert "is empty" in out and "scripts/compose_secrets.sh" in out


def test_clean_tiers_deletes_kvbm_pages_and_nothing_else(stack_redis):
    """scripts/clean_tiers.py redis on the stack's Redis: every page KVBM wrote
    (two generations, one sealed under a page secret) goes, another
    application's keys stay."""
    import sys

    import torch

    from helpers import ROOT
    from vllm_kvbm.config import load_config, parse_remote_url
    from vllm_kvbm.tiers.redis.store import RedisStore

    port, password_file, start, _ = stack_redis
    client = wait_until_up(port, password_file.read_text(), start())
    url = f"redis://127.0.0.1:{port}"
    cfg = load_config(
        {}, environ={"KVBM_REMOTE_URL": url, "KVBM_REMOTE_PASSWORD_FILE": str(password_file)}
    )
    target = parse_remote_url("remote_url", url)
    for namespace, secret in (("vllm-0.32.0", None), ("vllm-0.33.0", b"s" * 32)):
        store = RedisStore(target, cfg.remote_password, 4096, namespace, 0, 1, page_secret=secret)
        try:
            for i in range(5):
                assert store.put(bytes([i]) * 32, torch.full((4096,), i, dtype=torch.uint8))
        finally:
            store.close()
    client.set("app:session:1", "someone else's")
    client.set("kvbm_settings", "not a page name")
    assert client.dbsize() == 12

    def clean(*args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts/clean_tiers.py"),
                "redis",
                url,
                "--password-file",
                str(password_file),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    dry = clean("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 10 keys" in dry.stdout and client.dbsize() == 12
    proc = clean()
    assert proc.returncode == 0, proc.stderr
    assert "deleted 10 keys" in proc.stdout
    assert sorted(client.keys()) == [b"app:session:1", b"kvbm_settings"]
    assert password_file.read_text() not in proc.stdout + proc.stderr
