"""Two real engines find each other through the peer directory, with no router
naming the peer: engine A serves its shared pool (pool_serve_port) and lists
its pages in a real ``redis-server`` (peer_directory_url, password from a
file) with its liveness; engine B (peer_reads, the same directory) gets a
plain request, asks the directory which live peer holds the prompt's pages,
asks A's pool and reads them out of A's memory over NIXL. Greedy outputs
equal a plain engine's recompute. With the directory stopped, B's request is
a recompute within bounded time, without an error.
"""

from __future__ import annotations

import time

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from test_peer_e2e import port, settle, shm, tokens_of  # noqa: F401 (fixtures)
from test_redis_e2e import password_file, redis_server  # noqa: F401 (fixtures)
from vllm_kvbm.tiers.peer import directory as pd
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

PROMPT = random_prompt(10 * BLOCK_SIZE + 40, seed=9401)


def directory_config(redis_server, password_file, **kw) -> dict:  # noqa: F811
    return kvbm_transfer_config(
        host_cache_blocks=16,
        peer_directory_url=redis_server.url,
        remote_password_file=str(password_file),
        remote_timeout_s=1.0,
        **EVERY_PAGE_LOADED,
        **kw,
    )


@pytest.fixture(scope="module")
def engine_a(shm, port, model_dir, redis_server, password_file):  # noqa: F811
    llm = make_llm(
        directory_config(
            redis_server,
            password_file,
            pool_cache_size="96MiB",
            pool_dir=shm,
            pool_serve_port=port,
            pool_serve_host="127.0.0.1",
        )
    )
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def engine_b(model_dir, engine_a, redis_server, password_file):  # noqa: F811
    llm = make_llm(
        directory_config(redis_server, password_file, peer_reads=True, peer_read_timeout_s=2)
    )
    yield llm
    shutdown(llm)


def entries(srv) -> dict[str, int]:
    """endpoint -> how many page entries name it."""
    counts: dict[str, int] = {}
    with srv.admin() as c:
        for name in c.scan_iter(match=f"{pd.KEY_PREFIX}:*", count=1000):
            holder = c.get(name)
            if holder is not None:
                counts[holder.decode()] = counts.get(holder.decode(), 0) + 1
    return counts


def listed_at_least(srv, endpoint: str, n: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := entries(srv).get(endpoint, 0)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_a_request_without_a_hint_reads_the_prefix_from_the_peer_the_directory_names(
    engine_a, engine_b, plain_llm, redis_server, port
):  # noqa: F811
    endpoint = f"tcp://127.0.0.1:{port}"
    want = reference(plain_llm, [PROMPT])[0]
    assert generate(engine_a, [PROMPT])[0] == [want]  # computed by A: in its pool
    settle(engine_a)
    pages = len(PROMPT) // BLOCK_SIZE
    assert listed_at_least(redis_server, endpoint, pages) >= pages  # A listed them
    with redis_server.admin() as c:
        assert c.exists(pd.alive_key(endpoint))  # and keeps its liveness
    matched, read = kvbm_counter("matched_tokens_peer"), kvbm_counter("onboard_blocks_peer")
    out = generate_request(engine_b, {"prompt_token_ids": PROMPT})  # no hint
    assert tokens_of(out) == want
    assert out.num_cached_tokens == expected_hit_tokens(len(PROMPT))
    assert kvbm_counter("matched_tokens_peer") - matched == out.num_cached_tokens
    assert kvbm_counter("onboard_blocks_peer") - read == pages


def test_with_the_directory_down_a_request_is_a_recompute_in_bounded_time(
    engine_a, engine_b, plain_llm, redis_server, port
):  # noqa: F811
    endpoint = f"tcp://127.0.0.1:{port}"
    p = random_prompt(8 * BLOCK_SIZE + 9, seed=9402)
    want = reference(plain_llm, [p])[0]
    before = entries(redis_server).get(endpoint, 0)
    assert generate(engine_a, [p])[0] == [want]
    settle(engine_a)
    assert listed_at_least(redis_server, endpoint, before + 8) >= before + 8
    redis_server.kill()  # A's pages are in its pool, the directory is gone
    matched = kvbm_counter("matched_tokens_peer")
    t0 = time.monotonic()
    out = generate_request(engine_b, {"prompt_token_ids": p})
    assert tokens_of(out) == want
    assert out.num_cached_tokens == 0
    assert kvbm_counter("matched_tokens_peer") == matched
    assert "kvbm_error" not in (out.kv_transfer_params or {})
    assert time.monotonic() - t0 < 30
