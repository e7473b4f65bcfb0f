"""Pages of two blocks (page_tokens 256 at block size 128) on a real engine:
greedy outputs onboarded from the host tier and from disk, including a page
whose first block vLLM's own prefix cache already holds, equal a plain
engine's recompute."""

from __future__ import annotations

import pytest

from helpers.engines import BLOCK_SIZE, kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import generate, reference
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

PAGE = 2 * BLOCK_SIZE
HOST_BLOCKS = 40  # 20 pages


def page_hit(n: int) -> int:
    """Whole pages only, and vLLM computes at least the last token itself."""
    return (n - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def pages_llm(model_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kvbm-pages-disk")
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            page_tokens=PAGE,
            disk_cache_dir=str(disk),
            disk_cache_size="1GiB",
        )
    )
    yield llm
    shutdown(llm)


def test_host_pages_onboard_whole_and_equal_recompute(pages_llm, plain_llm):
    prompt = random_prompt(1000, seed=31)  # 3 full pages and a half
    want = reference(plain_llm, [prompt])
    first, _ = generate(pages_llm, [prompt])
    pages_llm.reset_prefix_cache()
    before = kvbm_counter("onboard_blocks_h2d")
    second, cached = generate(pages_llm, [prompt])
    assert first == want and second == want
    assert cached[0] == page_hit(1000) == 768
    assert kvbm_counter("onboard_blocks_h2d") - before == 768 // BLOCK_SIZE


def test_a_page_half_in_vllms_own_cache_loads_its_other_block(pages_llm, plain_llm):
    prompt = random_prompt(1100, seed=32)
    want = reference(plain_llm, [prompt])
    generate(pages_llm, [prompt])  # stores pages 0-3 (1024 tokens)
    pages_llm.reset_prefix_cache()
    # vLLM caches block 0 again, alone: a 200-token prompt is under a page,
    # so KVBM neither loads nor stores for it.
    generate(pages_llm, [prompt[:BLOCK_SIZE] + random_prompt(72, seed=33)], max_tokens=1)
    before = kvbm_counter("onboard_blocks_h2d")
    got, cached = generate(pages_llm, [prompt])
    assert got == want
    assert cached[0] == page_hit(1100) == 1024  # block 0 vLLM's, blocks 1-7 loaded
    assert kvbm_counter("onboard_blocks_h2d") - before == 7


def test_disk_pages_onboard_and_equal_recompute(pages_llm, plain_llm):
    prompt = random_prompt(10 * BLOCK_SIZE + 40, seed=34)  # 5 pages
    want = reference(plain_llm, [prompt])
    generate(pages_llm, [prompt])
    clear_engine_and_host(pages_llm, HOST_BLOCKS)  # only the disk keeps it
    before = kvbm_counter("onboard_blocks_d2d")
    got, cached = generate(pages_llm, [prompt])
    assert got == want
    assert cached[0] == page_hit(len(prompt)) == 5 * PAGE
    assert kvbm_counter("onboard_blocks_d2d") - before == 5  # pages read from disk
