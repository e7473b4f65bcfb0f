"""A real engine onboards a disk prefix longer than its host tier: the pages
without a host slot are streamed through the worker's staging slots
(tests/unit/test_streaming.py covers the worker and scheduler sides)."""

from __future__ import annotations

import time

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from test_tiers_e2e import clear_engine_and_host, settle
from vllm_kvbm.tools.server import kvbm_transfer_config

HOST_BLOCKS = 8


def test_engine_onboards_a_disk_prefix_longer_than_its_host_tier(model_dir, plain_llm, tmp_path):
    """An engine with an 8-block host tier writes a 2600-token prompt (20
    pages) to disk; once only the disk keeps it (the host tier filled with
    other prompts, vLLM's own cache cleared), it onboards all of it and
    answers as a plain engine that recomputed it. One engine does both (the
    store path past the host tier: test_store_backlog_e2e)."""
    prompt = random_prompt(2600, seed=9201)
    want = reference(plain_llm, [prompt])
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(tmp_path),
            disk_cache_size="1GiB",
            **EVERY_PAGE_LOADED,
        )
    )
    try:
        assert generate(llm, [prompt])[0] == want
        # The pages past the host tier's slots reach the disk as the steps
        # after the request free slots (each settle is one).
        deadline = time.monotonic() + 60
        while (
            len(list(tmp_path.glob("*.pt"))) < len(prompt) // BLOCK_SIZE
            and time.monotonic() < deadline
        ):
            settle(llm)
        assert len(list(tmp_path.glob("*.pt"))) == len(prompt) // BLOCK_SIZE
        clear_engine_and_host(llm, HOST_BLOCKS)
        before = kvbm_counter("onboard_blocks_d2d")
        got, cached = generate(llm, [prompt])
        assert got == want
        assert cached[0] == expected_hit_tokens(len(prompt))
        assert kvbm_counter("onboard_blocks_d2d") - before == cached[0] // BLOCK_SIZE
    finally:
        shutdown(llm)
