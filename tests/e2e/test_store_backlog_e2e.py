"""A prompt longer than the host tier is stored whole to disk (issue 22 item 4):
the pages a step computes beyond the host tier's free slots wait as the
request's backlog and reach the disk through the host tier as its slots are
spilled and freed; after the host tier and vLLM's cache are cleared, the
prompt comes back from disk whole, and outputs equal a plain engine's."""

from __future__ import annotations

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import generate, reference
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

HOST_BLOCKS = 12


def _round_trip(llm, plain, prompt, hit_tokens, host_blocks=HOST_BLOCKS, block_size=BLOCK_SIZE):
    want = reference(plain, [prompt])
    skipped = kvbm_counter("store_skipped_blocks")
    assert generate(llm, [prompt])[0] == want  # computes; stores all of it
    # clear_engine_and_host counts in blocks of the default size
    clear_engine_and_host(llm, host_blocks * block_size // BLOCK_SIZE)
    assert kvbm_counter("store_skipped_blocks") == skipped
    before = kvbm_counter("matched_tokens_disk")
    got, cached = generate(llm, [prompt])
    assert got == want
    assert cached[0] == hit_tokens
    assert kvbm_counter("matched_tokens_disk") - before == hit_tokens


def test_a_prompt_longer_than_the_host_tier_comes_back_from_disk(model_dir, plain_llm, tmp_path):
    """3200 tokens (25 blocks of 128) with a 12-block host tier: 3072 tokens
    from disk (vLLM computes the last block's last token)."""
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(tmp_path),
            disk_cache_size="1GiB",
            **EVERY_PAGE_LOADED,
        )
    )
    try:
        _round_trip(llm, plain_llm, random_prompt(3200, seed=9401), 3072)
    finally:
        shutdown(llm)


def test_small_blocks_and_pages_longer_than_the_host_tier(model_dir, tmp_path):
    """32-token blocks, 256-token pages, a 24-block host tier (3 pages): a
    2000-token prompt comes back with 1792 tokens (7 whole pages)."""
    plain = make_llm(None, block_size=32)
    try:
        llm = make_llm(
            kvbm_transfer_config(
                host_cache_blocks=24,
                page_tokens=256,
                disk_cache_dir=str(tmp_path),
                disk_cache_size="1GiB",
                **EVERY_PAGE_LOADED,
            ),
            block_size=32,
        )
        try:
            _round_trip(
                llm, plain, random_prompt(2000, seed=9402), 1792, host_blocks=24, block_size=32
            )
        finally:
            shutdown(llm)
    finally:
        shutdown(plain)
