"""Engines whose KV bytes differ never share pages, on real engines: two
block sizes with the same page size on one disk directory, under keys from
our own chain (xxhash: vLLM's hashes do not qualify)."""

from __future__ import annotations

import glob

import pytest

from helpers.engines import kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import generate
from test_tiers_e2e import settle
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

PAGE = 256  # the default page at both block sizes below (8 x 32, 4 x 64)


def _engine(block_size: int, disk=None):
    kv = None
    if disk is not None:
        kv = kvbm_transfer_config(host_cache_size="256MiB", page_tokens=PAGE,
                                  disk_cache_dir=str(disk), disk_cache_size="1GiB")
    return make_llm(kv, block_size=block_size, prefix_caching_hash_algo="xxhash")


def _shutdown(llm) -> None:
    shutdown(llm)


def test_another_block_size_on_one_disk_directory_misses(model_dir, tmp_path):
    prompt = random_prompt(1100, seed=2020)
    first = _engine(32, tmp_path)
    try:
        generate(first, [prompt])
        settle(first)
    finally:
        _shutdown(first)
    assert len(glob.glob(str(tmp_path / "*.pt"))) >= 1100 // PAGE  # the pages are there

    second = _engine(64, tmp_path)
    try:
        before = kvbm_counter("onboard_blocks_d2d")
        _, cached = generate(second, [prompt])
        loaded = kvbm_counter("onboard_blocks_d2d") - before
    finally:
        _shutdown(second)
    assert loaded == 0 and cached[0] == 0  # another layout per block: a miss
