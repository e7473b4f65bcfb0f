"""A gpt-oss-shaped model (sliding-window layers with a 128-token window
alternating with full-attention layers, a learned sink logit per head, a
mixture of experts; float32) with vLLM's hybrid allocator (HMA) on. vLLM
declares its layers a plain SlidingWindowSpec and FullAttentionSpec: the
sinks are weights the attention kernel adds to each head's softmax, not
anything in the KV blocks, so the blocks hold plain K and V and KVBM serves
the model group by group (scheduler/group_pages.py). Greedy outputs with KV
onboarded from the host and the disk tiers, in a batch and across a growing
conversation, equal those of a plain engine (HMA on) that recomputed them.
The model is built locally (tools/local_model), tiny and random.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from test_hybrid_window_e2e import hits_from_host_then_disk, recomputed
from test_tiers_e2e import settle
from vllm_kvbm.tools.local_model import GPT_OSS_DIR, build_gpt_oss
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 48  # every page of the four prompts (34)
ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096)  # 128-token blocks, float32
LENGTHS = (129, 300, 1001, 2049)  # one page, past the window, 7 and 16 pages
# The hit of each: its full pages but the one holding its last token
HITS = [128, 256, 896, 2048]
# Pages of 128 tokens stored per prompt: every page of the full-attention
# group; of the sliding group (a 127-token window: one page) only the page
# before the prompt's last full page and before every 4 pages (4 windows):
# 129: 1 + 1, 300: 2 + 1, 1001: 7 + 2 (pages 3, 6), 2049: 16 + 4 (pages 3,
# 7, 11, 15). Stored whole (HMA off) they would be 2 * 26 = 52.
STORED_PAGES = 2 + 3 + 9 + 20


@pytest.fixture(scope="module")
def gpt_oss():
    return str(build_gpt_oss(ROOT / GPT_OSS_DIR))


@pytest.fixture(scope="module")
def plain(gpt_oss, same_binding):  # noqa: F811
    llm = make_llm(None, model=gpt_oss, **ENGINE)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvbm(gpt_oss, same_binding, tmp_path_factory):  # noqa: F811
    llm = make_llm(kvbm_transfer_config(host_cache_blocks=HOST_BLOCKS,
                                        disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
                                        disk_cache_size="256MiB", **EVERY_PAGE_LOADED),
                   model=gpt_oss, **ENGINE)
    yield llm
    shutdown(llm)


def test_sink_model_stores_only_windows_and_hits_equal_recompute(plain, kvbm):
    config = kvbm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompts = [random_prompt(n, seed=9300 + n) for n in LENGTHS]
    want = recomputed(plain, prompts)
    stored = kvbm_counter("offload_blocks_d2h")
    for p, w in zip(prompts, want):  # computed one by one, stored
        assert generate(kvbm, [p])[0] == [w]
    settle(kvbm)
    # A sink-specific spec would keep the model out of KVBM: nothing stored.
    assert kvbm_counter("offload_blocks_d2h") - stored == STORED_PAGES

    hits_from_host_then_disk(kvbm, prompts, want, HITS)  # one batch each


def test_sink_model_growing_conversation_equals_recompute(plain, kvbm):
    """Each turn sends the last turn's prompt and answer and a new message:
    its hit is the last prompt's pages, whose last window was stored."""
    conversation = random_prompt(700, seed=9401)
    for turn in range(3):
        want = recomputed(plain, [conversation])[0]
        assert kvbm.reset_prefix_cache()
        got, cached = generate(kvbm, [conversation])
        assert got[0] == want
        if turn:
            assert cached[0] == previous // 128 * 128
        previous = len(conversation)
        conversation = conversation + want + random_prompt(300, seed=9410 + turn)
