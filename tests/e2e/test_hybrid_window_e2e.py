"""A Gemma 3-shaped model (five sliding-window layers with a 256-token
window, then a full-attention layer; float32) with vLLM's hybrid allocator
(HMA) on, served by KVBM group by group (scheduler/group_pages.py): its
sliding layers store only the windows a hit reads, counted page by page, and
greedy outputs with KV onboarded from the host and the disk tiers, in a batch
and across a growing conversation, equal those of a plain engine (HMA on)
that recomputed them. The model is built locally (tools/local_model), tiny
and random.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from test_tiers_e2e import settle
from vllm_kvbm.tools.local_model import GEMMA3_DIR, build_gemma3
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)


def only_lower_tiers_keep(llm, fillers: int = 3) -> None:
    """Fresh 3000-token prompts push every page stored before out of the host
    tier (their pages and group pages outnumber its slots, LRU), then vLLM's
    own prefix cache is cleared: only the disk and remote tiers keep them."""
    settle(llm)
    for i in range(fillers):
        generate(llm, [random_prompt(3000, seed=9990 + i)], max_tokens=1)
    settle(llm)
    assert llm.reset_prefix_cache()


def hits_from_host_then_disk(llm, prompts, want, hits) -> None:
    """``prompts`` (stored before) in one batch, vLLM's own cache cleared:
    outputs ``want`` with ``hits`` tokens from the host tier; then again
    from the disk tier once only the lower tiers keep them."""
    for tier in ("host", "disk"):
        if tier == "host":
            assert llm.reset_prefix_cache()  # vLLM's own cache only
        else:
            only_lower_tiers_keep(llm)
        before = kvbm_counter(f"matched_tokens_{tier}")
        got, cached = generate(llm, prompts)
        assert got == want and cached == hits
        assert kvbm_counter(f"matched_tokens_{tier}") - before == sum(hits)


def recomputed(plain, prompts):
    """Greedy outputs of the plain engine, its own prefix cache cleared first."""
    assert plain.reset_prefix_cache()
    return generate(plain, prompts)[0]


# ---- Gemma 3: sliding-window groups ------------------------------------------

G3_HOST_BLOCKS = 96  # every page of the four prompts (71)
G3_ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096)  # 128-token blocks, float32
G3_LENGTHS = (129, 300, 1001, 2049)  # one page, past the window, four and eight windows
# The hit of each: its full pages but the one holding its last token
G3_HITS = [128, 256, 896, 2048]
# Pages of 128 tokens stored per prompt: every full-attention page; of each
# of the five sliding groups only the pages in the 255 tokens (2 pages)
# before the prompt's last full page and before every 8 pages (4 windows):
# 129: 1 + 5*1, 300: 2 + 5*2, 1001: 7 + 5*2 (pages 5, 6), 2049: 16 + 5*4
# (pages 6, 7, 14, 15). Stored whole (HMA off) they would be 6 * 26 = 156.
G3_STORED_PAGES = 6 + 12 + 17 + 36


@pytest.fixture(scope="module")
def gemma3():
    return str(build_gemma3(ROOT / GEMMA3_DIR))


@pytest.fixture(scope="module")
def plain_g3(gemma3, same_binding):  # noqa: F811
    llm = make_llm(None, model=gemma3, **G3_ENGINE)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvbm_g3(gemma3, same_binding, tmp_path_factory):  # noqa: F811
    llm = make_llm(kvbm_transfer_config(host_cache_blocks=G3_HOST_BLOCKS,
                                        disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
                                        disk_cache_size="256MiB", **EVERY_PAGE_LOADED),
                   model=gemma3, **G3_ENGINE)
    yield llm
    shutdown(llm)



def test_sliding_window_model_stores_only_windows_and_hits_equal_recompute(plain_g3, kvbm_g3):
    config = kvbm_g3.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompts = [random_prompt(n, seed=9500 + n) for n in G3_LENGTHS]
    want = recomputed(plain_g3, prompts)
    stored = kvbm_counter("offload_blocks_d2h")
    for p, w in zip(prompts, want):  # computed one by one, stored
        assert generate(kvbm_g3, [p])[0] == [w]
    settle(kvbm_g3)
    assert kvbm_counter("offload_blocks_d2h") - stored == G3_STORED_PAGES

    hits_from_host_then_disk(kvbm_g3, prompts, want, G3_HITS)


def test_sliding_window_model_growing_conversation_equals_recompute(plain_g3, kvbm_g3):
    """Each turn sends the last turn's prompt and answer and a new message:
    its hit is the last prompt's pages, whose last window was stored."""
    conversation = random_prompt(700, seed=9601)
    for turn in range(3):
        want = recomputed(plain_g3, [conversation])[0]
        assert kvbm_g3.reset_prefix_cache()
        got, cached = generate(kvbm_g3, [conversation])
        assert got[0] == want
        if turn:
            assert cached[0] == previous // 128 * 128
        previous = len(conversation)
        conversation = conversation + want + random_prompt(300, seed=9610 + turn)

