"""Sealed pages on the remote tiers: a real redis-server and a real LMCache server.

A reader of the server without the page secret finds no KV bytes and no page
key in any stored value or name, and cannot compute the names; a TP rank's
page swapped with its twin of the other rank is refused by both ranks (with
or without a secret). The codec and the disk tier: tests/unit/test_sealed_pages.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import SMALL, leaks, page  # noqa: E402
from test_redis_store import PASSWORD, RedisServer  # noqa: E402
from test_remote_store import raw_get, raw_put  # noqa: E402
from vllm_kvbm.config import parse_remote_url  # noqa: E402
from vllm_kvbm.config.secrets import Secret  # noqa: E402
from vllm_kvbm.tiers.page_names import page_name  # noqa: E402

SECRET = b"kvbm-test-deployment-secret-0001"
NS = "model-a|float32|layout"


@pytest.fixture
def redis_server(tmp_path):
    srv = RedisServer(tmp_path, maxmemory="64mb").start()
    try:
        yield srv
    finally:
        srv.kill()


def _redis_store(srv, rank, world, secret):
    from vllm_kvbm.tiers.redis.store import RedisStore

    return RedisStore(
        parse_remote_url("remote_url", srv.url),
        Secret(PASSWORD, "remote_password_file f"),
        SMALL,
        NS,
        rank,
        world,
        2.0,
        retry_interval_s=0.3,
        page_secret=secret,
        layout="L",
    )


def test_redis_reader_without_the_secret_sees_no_kv_and_cannot_name_pages(redis_server):
    keys = [os.urandom(32) for _ in range(3)]
    pages = [page(50 + i, SMALL) for i in range(3)]
    store = _redis_store(redis_server, 0, 1, SECRET)
    try:
        for k, p in zip(keys, pages):
            assert store.put(k, p)
        with redis_server.admin() as c:
            names = list(c.scan_iter())
            stored = b"".join(names) + b"".join(c.get(n) for n in names)
            assert len(names) == 3
            for k, p in zip(keys, pages):
                assert leaks(stored, k, p) == []
                # The names a reader without the secret can compute are not there.
                assert not c.exists(page_name(NS, SMALL, 0, 1, k))
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert store.get_into(keys[0], out) == "ok" and torch.equal(out, pages[0])
    finally:
        store.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
def test_redis_rank_pages_swapped_are_refused_by_both_ranks(redis_server, secret):
    k = os.urandom(32)
    stores = [_redis_store(redis_server, r, 2, secret) for r in (0, 1)]
    try:
        for r, s in enumerate(stores):
            assert s.put(k, page(60 + r, SMALL))
        names = [s._page_name(k) for s in stores]
        assert names[0] != names[1]
        with redis_server.admin() as c:
            values = [c.get(n) for n in names]
            c.set(names[0], values[1])
            c.set(names[1], values[0])
            out = torch.empty(SMALL, dtype=torch.uint8)
            want = "corrupt" if secret is None else "unauthenticated"
            for s, n in zip(stores, names):
                assert s.get_into(k, out) == want
                assert not c.exists(n)  # deleted
    finally:
        for s in stores:
            s.close()


def _lm_store(lm_server, rank, world, secret):
    from vllm_kvbm.tiers.lm.store import RemoteStore

    return RemoteStore(
        lm_server.url, SMALL, NS, rank, world, timeout_s=3.0, page_secret=secret, layout="L"
    )


def test_lm_server_values_carry_no_kv_and_rank_swaps_are_refused(lm_server):
    k = os.urandom(32)
    pages = [page(70 + r, SMALL) for r in (0, 1)]
    for secret in (None, SECRET):
        stores = [_lm_store(lm_server, r, 2, secret) for r in (0, 1)]
        try:
            for s, p in zip(stores, pages):
                assert s.put(k, p)
            values = [raw_get(s, k) for s in stores]
            if secret is not None:
                for v, p in zip(values, pages):
                    assert leaks(v, k, p) == []
                assert stores[0]._ckey(k).to_string() != page_name(NS, SMALL, 0, 2, k)
            else:
                assert leaks(values[0], k, pages[0])  # the search finds them in the clear
            raw_put(stores[0], k, values[1])
            raw_put(stores[1], k, values[0])
            out = torch.empty(SMALL, dtype=torch.uint8)
            want = "corrupt" if secret is None else "unauthenticated"
            for s in stores:
                assert s.get_into(k, out) == want
                assert s.get_into(k, out) == "miss"  # overwritten with a tombstone
        finally:
            for s in stores:
                s.close()


def test_lm_store_logs_no_key_material_for_a_refused_page(lm_server, caplog):
    """A page refused under a page secret is logged, and overwritten, by
    count: no digits of its key (which anyone can recompute from a guessed
    prompt) appear in the log."""
    import logging

    k = os.urandom(32)
    stores = [_lm_store(lm_server, r, 2, SECRET) for r in (0, 1)]
    try:
        for r, s in enumerate(stores):
            assert s.put(k, page(80 + r, SMALL))
        raw_put(stores[0], k, raw_get(stores[1], k))  # rank 1's page under rank 0's name
        out = torch.empty(SMALL, dtype=torch.uint8)
        with caplog.at_level(logging.DEBUG):
            assert stores[0].get_into(k, out) == "unauthenticated"
        assert "unauthenticated" in caplog.text and "overwritten" in caplog.text
        text = caplog.text.lower()
        for needle in (k.hex(), f"{int.from_bytes(k, 'big'):x}", k.hex()[:8], k.hex()[-8:]):
            assert needle not in text
    finally:
        for s in stores:
            s.close()
