"""A real engine onboards a disk prefix longer than its host tier: the pages
without a host slot are streamed through the worker's staging slots
(tests/unit/test_streaming.py covers the worker and scheduler sides)."""

from __future__ import annotations

from helpers.engines import (BLOCK_SIZE, EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt,
                             shutdown)
from test_engine_e2e import expected_hit_tokens, generate, reference
from test_tiers_e2e import settle
from vllm_kvbm.tools.server import kvbm_transfer_config


def test_engine_onboards_a_disk_prefix_longer_than_its_host_tier(model_dir, plain_llm, tmp_path):
    """Engine A (a host tier big enough) writes a 2600-token prompt to disk;
    engine B, on the same directory with an 8-block host tier, onboards all of
    it and answers as a plain engine that recomputed it."""
    prompt = random_prompt(2600, seed=9201)
    want = reference(plain_llm, [prompt])

    def engine(host_blocks: int):
        return make_llm(kvbm_transfer_config(host_cache_blocks=host_blocks,
                                             disk_cache_dir=str(tmp_path),
                                             disk_cache_size="1GiB",
                                             **EVERY_PAGE_LOADED))

    a = engine(24)
    try:
        assert generate(a, [prompt])[0] == want
        settle(a)
    finally:
        shutdown(a)
    assert len(list(tmp_path.glob("*.pt"))) == len(prompt) // BLOCK_SIZE

    b = engine(8)
    try:
        before = kvbm_counter("onboard_blocks_d2d")
        got, cached = generate(b, [prompt])
        assert got == want
        assert cached[0] == expected_hit_tokens(len(prompt))
        assert kvbm_counter("onboard_blocks_d2d") - before == cached[0] // BLOCK_SIZE
    finally:
        shutdown(b)
