"""Engines whose KV bytes differ never share pages, on real engines: one
engine writes a prompt's pages to a disk directory, then engines that differ
from it in one way each find none of them there. Another block size with the
same page size, under keys from our own chain (xxhash: vLLM's hashes do not
qualify); --hf-overrides (another RoPE base: same files, same config.json,
other K), whose own recompute differs from the first engine's answer."""

from __future__ import annotations

import glob

import pytest

from helpers.engines import kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import generate
from test_tiers_e2e import settle
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

PAGE = 256  # the default page at both block sizes below (8 x 32, 4 x 64)
PROMPT = random_prompt(1100, seed=2020)
# The test model's RoPE base is 500000; another base changes every K.
ROPE = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def _engine(block_size: int, disk, **overrides):
    kv = kvbm_transfer_config(
        host_cache_size="256MiB", page_tokens=PAGE, disk_cache_dir=str(disk), disk_cache_size="1GiB"
    )
    return make_llm(kv, block_size=block_size, prefix_caching_hash_algo="xxhash", **overrides)


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    """The first engine's answer to PROMPT, its pages on a disk directory (the
    engine stopped): the module's tests each start an engine on that directory."""
    disk = tmp_path_factory.mktemp("disk")
    first = _engine(32, disk)
    try:
        base, _ = generate(first, [PROMPT])
        settle(first)
    finally:
        shutdown(first)
    return disk, base


def _loaded_by(llm) -> tuple[list[int], int, float]:
    """PROMPT's answer on ``llm``, its cached tokens and the pages it loaded
    from disk; the engine stopped after."""
    try:
        before = kvbm_counter("onboard_blocks_d2d")
        got, cached = generate(llm, [PROMPT])
        return got, cached[0], kvbm_counter("onboard_blocks_d2d") - before
    finally:
        shutdown(llm)


def test_another_block_size_on_one_disk_directory_misses(written):
    disk, _ = written
    assert len(glob.glob(str(disk / "*.pt"))) >= len(PROMPT) // PAGE  # the pages are there
    _, cached, loaded = _loaded_by(_engine(64, disk))
    assert loaded == 0 and cached == 0  # another layout per block: a miss


def test_hf_overrides_on_one_disk_directory_misses(written):
    """An engine with --hf-overrides finds none of the first engine's pages on
    the shared disk directory, and its own recompute differs from the first
    engine's answer."""
    disk, base = written
    assert len(glob.glob(str(disk / "*.pt"))) >= len(PROMPT) // PAGE  # the pages are there
    got, cached, loaded = _loaded_by(_engine(32, disk, hf_overrides=ROPE))
    assert loaded == 0 and cached == 0
    # Nothing was loaded, so `got` is the override's own recompute, and the
    # override changes the model's answer: sharing would have shown.
    assert got != base
