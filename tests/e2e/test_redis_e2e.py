"""The remote tier on a real Redis server, with real engines: onboarding,
sharing between engines, corruption, a frozen and a killed server.

Engines have a small host tier and Redis (password from a file) as their
only lower tier, so a prompt pushed out of the host tier (other prompts fill
it) and out of vLLM's own cache can only come back from Redis. Engine 2
starts after engine 1 exits, on the same server: what it finds there, engine
1 wrote.
"""

from __future__ import annotations

import time

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from test_redis_store import PASSWORD, RedisServer
from test_tiers_e2e import HOST_BLOCKS, clear_engine_and_host, settle
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"), PASSWORD, "512mb", "allkeys-lru").start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def password_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "redis-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


def redis_config(srv: RedisServer, password_file) -> dict:
    return kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        remote_url=srv.url,
        remote_password_file=str(password_file),
        remote_timeout_s=TIMEOUT_S,
        **EVERY_PAGE_LOADED,
    )


@pytest.fixture(scope="module")
def engine1(model_dir, redis_server, password_file):
    llm = make_llm(redis_config(redis_server, password_file))
    yield llm
    try:
        shutdown(llm)
    except Exception:  # already shut down before engine 2 started
        pass


@pytest.fixture(scope="module")
def engine2(model_dir, redis_server, password_file, engine1):
    shutdown(engine1)  # engine 1 exits; its pages stay on Redis
    llm = make_llm(redis_config(redis_server, password_file))
    yield llm
    shutdown(llm)


def page_keys(srv: RedisServer) -> set[bytes]:
    with srv.admin() as c:
        return set(c.keys("kvbm_*"))


PROMPT_A = random_prompt(10 * BLOCK_SIZE + 40, seed=9101)
PROMPT_FLIP = random_prompt(6 * BLOCK_SIZE + 3, seed=9102)
PROMPT_SHARED = random_prompt(8 * BLOCK_SIZE, seed=9103)


def test_onboard_from_redis_equals_recompute(engine1, plain_llm, redis_server):
    want = reference(plain_llm, [PROMPT_A])
    before = page_keys(redis_server)
    assert generate(engine1, [PROMPT_A])[0] == want  # computes; host, then Redis
    clear_engine_and_host(engine1)
    assert len(page_keys(redis_server) - before) >= len(PROMPT_A) // BLOCK_SIZE
    matched = kvbm_counter("matched_tokens_remote")
    onboarded = kvbm_counter("onboard_blocks_remote")
    got, cached = generate(engine1, [PROMPT_A])
    assert got == want
    assert cached[0] == expected_hit_tokens(len(PROMPT_A))
    assert kvbm_counter("matched_tokens_remote") - matched == cached[0]
    assert kvbm_counter("onboard_blocks_remote") - onboarded == cached[0] // BLOCK_SIZE


def test_corrupt_page_on_redis_is_recomputed_and_removed(engine1, plain_llm, redis_server):
    want = reference(plain_llm, [PROMPT_FLIP])
    before = page_keys(redis_server)
    generate(engine1, [PROMPT_FLIP])
    settle(engine1)
    pages = sorted(page_keys(redis_server) - before)
    clear_engine_and_host(engine1)
    assert len(pages) == len(PROMPT_FLIP) // BLOCK_SIZE
    victim = pages[len(pages) // 2]
    with redis_server.admin() as c:
        original = c.get(victim)
        offset = HEADER_BYTES + 1000
        c.setrange(victim, offset, bytes([original[offset] ^ 0xFF]))
        corrupted = c.get(victim)
    assert corrupted != original

    failures = kvbm_counter("checksum_failures")
    got, _ = generate(engine1, [PROMPT_FLIP])
    assert got == want
    assert kvbm_counter("checksum_failures") - failures >= 1
    settle(engine1)
    with redis_server.admin() as c:
        # Deleted, then written again from the recomputed block: never the bad bytes.
        assert c.get(victim) in (None, original)


def test_second_engine_hits_what_the_first_wrote(engine1, plain_llm, redis_server, request):
    # PROMPT_SHARED is computed by engine 1 only; `other` shares its first 5 blocks.
    other = PROMPT_SHARED[: 5 * BLOCK_SIZE] + random_prompt(3 * BLOCK_SIZE, seed=9104)
    want = reference(plain_llm, [PROMPT_SHARED, other])
    before = page_keys(redis_server)
    assert generate(engine1, [PROMPT_SHARED])[0] == [want[0]]
    settle(engine1)
    assert len(page_keys(redis_server) - before) == len(PROMPT_SHARED) // BLOCK_SIZE

    engine2 = request.getfixturevalue("engine2")  # engine 1 exits, engine 2 starts
    matched = kvbm_counter("matched_tokens_remote")
    got, cached = generate(engine2, [other])
    assert got == [want[1]]
    assert cached[0] == 5 * BLOCK_SIZE  # the shared prefix, from engine 1's pages
    assert kvbm_counter("matched_tokens_remote") - matched == 5 * BLOCK_SIZE
    got, cached = generate(engine2, [PROMPT_SHARED])
    assert got == [want[0]]
    assert cached[0] == expected_hit_tokens(len(PROMPT_SHARED))
    assert kvbm_counter("matched_tokens_remote") - matched >= 7 * BLOCK_SIZE


def test_frozen_then_killed_server_costs_only_hits(engine2, plain_llm, redis_server, capfd):
    base_p, frozen_p, back_p, dead_p = (
        random_prompt(6 * BLOCK_SIZE + 7, seed=s) for s in (9111, 9112, 9113, 9114)
    )
    want = reference(plain_llm, [base_p, frozen_p, back_p, dead_p])
    t0 = time.monotonic()
    assert generate(engine2, [base_p])[0] == [want[0]]
    base_s = time.monotonic() - t0

    redis_server.freeze()
    try:
        t0 = time.monotonic()
        got, _ = generate(engine2, [frozen_p])
        frozen_s = time.monotonic() - t0
        settle(engine2)  # its writes time out or fail fast meanwhile
    finally:
        redis_server.thaw()
    assert got == [want[1]]
    # The lookup and the first write each wait at most their timeouts, once.
    assert frozen_s < base_s + 4 * TIMEOUT_S + 10, (frozen_s, base_s)

    time.sleep(2.5)  # the links are re-made in the background (every 2 s at most)
    errors = kvbm_counter("tier_write_errors")
    assert generate(engine2, [back_p])[0] == [want[2]]
    clear_engine_and_host(engine2)
    matched = kvbm_counter("matched_tokens_remote")
    got, cached = generate(engine2, [back_p])  # written after the freeze: back from Redis
    assert got == [want[2]] and cached[0] == expected_hit_tokens(len(back_p))
    assert kvbm_counter("matched_tokens_remote") - matched == cached[0]
    assert kvbm_counter("tier_write_errors") == errors

    redis_server.kill()
    t0 = time.monotonic()
    assert generate(engine2, [dead_p])[0] == [want[3]]
    clear_engine_and_host(engine2)
    got, _ = generate(engine2, [back_p])  # its Redis pages are gone with the server
    assert got == [want[2]]
    assert time.monotonic() - t0 < 300
    out, err = capfd.readouterr()
    assert PASSWORD not in out + err
