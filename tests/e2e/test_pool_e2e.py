"""The shared page pool on a real engine: pages written through to a pool
file in /dev/shm come back from it once the host tier no longer holds them,
equal to a plain engine's recompute, and an engine started again on the same
pool file hits at once (its pages outlived the engine).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

from helpers.engines import (BLOCK_SIZE, EVERY_PAGE_LOADED, kvbm_counter, make_llm,
                             random_prompt, shutdown)
from test_engine_e2e import expected_hit_tokens, generate, reference
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

# 4 MiB pages (float32): 96 MiB holds 22 of them, two sets of 11, so the
# prompt's 10 pages are never evicted by each other.
POOL_SIZE = "96MiB"
PROMPT = random_prompt(10 * BLOCK_SIZE + 40, seed=9101)


@pytest.fixture(scope="module")
def shm():
    d = tempfile.mkdtemp(prefix="kvbm-e2e-pool-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def pool_config(shm: str) -> dict:
    return kvbm_transfer_config(host_cache_blocks=16, pool_cache_size=POOL_SIZE, pool_dir=shm,
                                **EVERY_PAGE_LOADED)


def pool_pages(shm: str) -> int:
    """Pages the pool file holds (its superblock's count), read as a view would."""
    import glob

    from vllm_kvbm.tiers.pool.layout import Superblock, read_used

    (path,) = glob.glob(f"{shm}/kvbm-pool-*-r0of1")
    with open(path, "rb") as f:
        head = f.read(4096)
    assert Superblock.unpack(head) is not None
    return read_used(head)


def settle(llm) -> None:
    """Lets the write-through land and a step collect it."""
    time.sleep(1.0)
    generate(llm, [[7] * 8], max_tokens=1)


def test_a_page_gone_from_the_host_tier_comes_back_from_the_pool(shm, plain_llm, model_dir):
    want = reference(plain_llm, [PROMPT])
    pages = len(PROMPT) // BLOCK_SIZE
    llm = make_llm(pool_config(shm))
    try:
        first, _ = generate(llm, [PROMPT])  # computed; host tier, then the pool
        settle(llm)
        assert pool_pages(shm) == pages
        # the host tier (and vLLM's own cache) forget it: only the pool has it
        assert llm.reset_prefix_cache(reset_connector=True)
        before = kvbm_counter("onboard_blocks_pool")
        got, cached = generate(llm, [PROMPT])
        assert first == want and got == want
        assert cached[0] == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("onboard_blocks_pool") - before == pages
    finally:
        shutdown(llm)

    # A new engine on the same pool file: the pages are there at once.
    again = make_llm(pool_config(shm))
    try:
        before = kvbm_counter("matched_tokens_pool")
        got, cached = generate(again, [PROMPT])
        assert got == want
        assert cached[0] == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("matched_tokens_pool") - before == cached[0]
    finally:
        shutdown(again)
