"""Two real engines share a prefix through the peer tier: engine A keeps its
pages in its shared pool (/dev/shm) and serves the pool to peers
(pool_serve_port); engine B (peer_reads) gets a request whose
kv_transfer_params carry a router's hint naming A's control endpoint, asks A
which pages it holds, reads them out of A's memory with one-sided NIXL READs
(UCX, between the two engines' worker processes), checks each page (key,
namespace, TP rank, layout, CRC) and onboards them as from its own host tier.
Greedy outputs equal a plain engine's recompute. Without a hint B looks at no
peer; a hint naming a peer that is gone costs a recompute, never a hang.
"""

from __future__ import annotations

import time

import pytest

from helpers.system import shm_dir
from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
    spare_core,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

PROMPT = random_prompt(10 * BLOCK_SIZE + 40, seed=9301)
OTHER = random_prompt(6 * BLOCK_SIZE + 3, seed=9302)
SECOND = random_prompt(8 * BLOCK_SIZE + 7, seed=9303)


@pytest.fixture(scope="module")
def shm():
    with shm_dir("kvbm-e2e-peer-") as d:
        yield d


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def engine_a(shm, port, model_dir):
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=16,
            pool_cache_size="96MiB",
            pool_dir=shm,
            pool_serve_port=port,
            pool_serve_host="127.0.0.1",
            **EVERY_PAGE_LOADED,
        )
    )
    yield llm
    try:
        shutdown(llm)
    except Exception:  # already shut down by the dead-peer test
        pass


@pytest.fixture(scope="module")
def engine_b(model_dir, engine_a):
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=16, peer_reads=True, peer_read_timeout_s=2, **EVERY_PAGE_LOADED
        )
    )
    yield llm
    shutdown(llm)


def hint(port: int) -> dict:
    return {
        "router_hint": {
            "source_control_endpoint": f"tcp://127.0.0.1:{port}",
            "block_hashes": list(range(1, 11)),
        }
    }


def settle(llm) -> None:
    """Lets the write-through to the pool land and a step collect it."""
    time.sleep(1.0)
    generate(llm, [[7] * 8], max_tokens=1)


def tokens_of(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_a_prefix_computed_by_one_engine_is_read_from_its_pool_by_another(
    engine_a, engine_b, plain_llm, port
):
    want = reference(plain_llm, [PROMPT])[0]
    assert generate(engine_a, [PROMPT])[0] == [want]  # computed by A: its pool has it
    settle(engine_a)
    pages = len(PROMPT) // BLOCK_SIZE
    matched, read = kvbm_counter("matched_tokens_peer"), kvbm_counter("onboard_blocks_peer")
    layered = kvbm_counter("onboard_layered_blocks")
    out = generate_request(engine_b, {"prompt_token_ids": PROMPT}, hint(port))
    assert tokens_of(out) == want
    assert out.num_cached_tokens == expected_hit_tokens(len(PROMPT))
    assert kvbm_counter("matched_tokens_peer") - matched == out.num_cached_tokens
    assert kvbm_counter("onboard_blocks_peer") - read == pages
    # B's first read from A (NIXL metadata, UCX's connection) loads before its step
    assert kvbm_counter("onboard_layered_blocks") == layered
    # now in B's own host tier: the same prompt hits there, no peer asked
    assert engine_b.reset_prefix_cache()
    host = kvbm_counter("matched_tokens_host")
    out = generate_request(engine_b, {"prompt_token_ids": PROMPT}, hint(port))
    assert tokens_of(out) == want
    assert kvbm_counter("matched_tokens_host") - host == out.num_cached_tokens > 0
    # from a peer read lately, a hit is read layer by layer during its step
    second = reference(plain_llm, [SECOND])[0]
    assert generate(engine_a, [SECOND])[0] == [second]
    settle(engine_a)
    read, layered = kvbm_counter("onboard_blocks_peer"), kvbm_counter("onboard_layered_blocks")
    out = generate_request(engine_b, {"prompt_token_ids": SECOND}, hint(port))
    assert tokens_of(out) == second
    assert out.num_cached_tokens == expected_hit_tokens(len(SECOND))
    assert kvbm_counter("onboard_blocks_peer") - read == len(SECOND) // BLOCK_SIZE
    if spare_core():
        assert kvbm_counter("onboard_layered_blocks") - layered == len(SECOND) // BLOCK_SIZE


def test_vllms_remote_kv_source_names_the_peer_too_and_no_hint_asks_no_peer(
    engine_a, engine_b, plain_llm, port
):
    want = reference(plain_llm, [OTHER])[0]
    assert generate(engine_a, [OTHER])[0] == [want]
    settle(engine_a)
    matched = kvbm_counter("matched_tokens_peer")
    got, cached = generate(engine_b, [OTHER])  # no hint: recomputed
    assert got == [want] and cached == [0]
    assert kvbm_counter("matched_tokens_peer") == matched
    assert engine_b.reset_prefix_cache(reset_connector=True)  # B forgets what it stored
    source = {
        "remote_kv_source": {
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "kv_request_id": "r-1",
        }
    }
    out = generate_request(engine_b, {"prompt_token_ids": OTHER}, source)
    assert tokens_of(out) == want
    assert out.num_cached_tokens == expected_hit_tokens(len(OTHER))
    assert kvbm_counter("matched_tokens_peer") - matched == out.num_cached_tokens


def test_a_bad_hint_is_reported_and_the_request_still_served(engine_b, plain_llm):
    p = random_prompt(3 * BLOCK_SIZE + 5, seed=9303)
    want = reference(plain_llm, [p])[0]
    out = generate_request(
        engine_b,
        {"prompt_token_ids": p},
        {"router_hint": {"source_control_endpoint": "http://nowhere"}},
    )
    assert tokens_of(out) == want
    assert "router_hint.source_control_endpoint" in out.kv_transfer_params["kvbm_error"]


def test_a_hint_naming_a_peer_that_is_gone_costs_a_recompute(engine_a, engine_b, plain_llm, port):
    p = random_prompt(8 * BLOCK_SIZE + 9, seed=9304)
    want = reference(plain_llm, [p])[0]
    assert generate(engine_a, [p])[0] == [want]
    settle(engine_a)
    shutdown(engine_a)  # A and its pool server are gone
    t0 = time.monotonic()
    out = generate_request(engine_b, {"prompt_token_ids": p}, hint(port))
    assert tokens_of(out) == want
    assert out.num_cached_tokens == 0
    assert time.monotonic() - t0 < 60
