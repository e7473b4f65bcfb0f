"""RedisStore.get_into receives a page straight into the host slot (its own
reading of the GET reply, checked chunk by chunk as it arrives), on a real
redis-server: every size and seal round-trips; a miss, a value of another
size, a header that decides the page early and an error reply each give
their status and leave the store's connections usable (a connection left
mid-reply would hand the next GET the rest of this one)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import redis
import torch

from helpers.tier_pages import key, page
from vllm_kvbm.config import parse_remote_url
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tiers.redis.store import RedisStore

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="redis-server not installed (scripts/setup_tools.sh installs it)",
    ),
]

SECRET = b"s" * 32


@pytest.fixture
def port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with redis.Redis("127.0.0.1", port, socket_timeout=2) as c:
                    c.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline and proc.poll() is None, "no redis-server"
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def make_store(port: int, block: int, secret: bytes | None = None) -> RedisStore:
    return RedisStore(
        parse_remote_url("remote_url", f"redis://127.0.0.1:{port}"),
        None,
        block,
        "ns-read",
        0,
        1,
        2.0,
        page_secret=secret,
    )


def admin(port: int) -> redis.Redis:
    return redis.Redis("127.0.0.1", port, socket_timeout=5)


def in_use(store: RedisStore) -> int:
    return len(store._link._client.connection_pool._in_use_connections)


# 4 KiB + 3: the whole reply fits the first read; 1 MiB + 5 crosses a check
# chunk; 3 MiB + 1: several chunks, and a tail
@pytest.mark.parametrize("block", [4096 + 3, (1 << 20) + 5, (3 << 20) + 1])
@pytest.mark.parametrize("secret", [None, SECRET], ids=["clear", "sealed"])
def test_pages_round_trip_into_the_slot(port, block, secret):
    store = make_store(port, block, secret)
    try:
        pages = {key(i): page(i, block) for i in range(3)}
        for k, p in pages.items():
            assert store.put(k, p)
        out = torch.empty(block, dtype=torch.uint8)
        for _ in range(2):  # the same connection again
            for k, p in pages.items():
                out.fill_(0)
                assert store.get_into(k, out) == "ok"
                assert torch.equal(out, p)
        assert store.get_into(key(99), out) == "miss"
        assert in_use(store) == 0
    finally:
        store.close()


def test_another_size_and_a_bad_header_are_corrupt_and_the_connection_stays_usable(port):
    block = (1 << 20) + 5
    store = make_store(port, block)
    try:
        out = torch.empty(block, dtype=torch.uint8)
        good, p = key(1), page(1, block)
        assert store.put(good, p)
        name = store._page_name
        with admin(port) as c:
            c.set(name(key(2)), os.urandom(HEADER_BYTES + block + 1))  # another size
            assert store.put(key(3), p)
            stored = bytearray(c.get(name(key(3))))
            stored[0] ^= 0xFF  # the magic: the header decides before the payload is read
            c.set(name(key(3)), bytes(stored))
        for bad in (key(2), key(3)):
            assert store.get_into(bad, out) == "corrupt"
            assert store.get_into(good, out) == "ok" and torch.equal(out, p)
            with admin(port) as c:
                assert not c.exists(name(bad))  # removed
        assert store._link.up and in_use(store) == 0
    finally:
        store.close()


def test_an_error_reply_is_an_error_and_the_link_stays_up(port):
    block = 4096
    store = make_store(port, block)
    try:
        out = torch.empty(block, dtype=torch.uint8)
        with admin(port) as c:
            c.rpush(store._page_name(key(5)), b"x")  # GET on a list: WRONGTYPE
        assert store.get_into(key(5), out) == "error"
        assert store._link.up
        assert store.put(key(6), page(6, block))
        assert store.get_into(key(6), out) == "ok" and torch.equal(out, page(6, block))
    finally:
        store.close()
