"""Models whose attention layers read a window of the prefix, with vLLM's
hybrid allocator (HMA) on, served by KVBM group by group
(scheduler/group_pages.py), float32:

- Gemma 3-shaped: five sliding-window layers with a 256-token window, then a
  full-attention layer;
- gpt-oss-shaped: 128-token sliding-window layers alternating with full
  attention, a learned sink logit per head, a mixture of experts. vLLM
  declares its layers a plain SlidingWindowSpec and FullAttentionSpec: the
  sinks are weights the attention kernel adds to each head's softmax, not
  anything in the KV blocks;
- Llama 4-shaped: three chunked-local attention layers (a token attends to
  its own 256-token chunk), then a full-attention layer, experts in every
  other layer.

Their windowed layers store only the pages a hit reads, counted page by page,
and greedy outputs with KV onboarded from the host and the disk tiers, in a
batch and across a growing conversation, equal those of a plain engine (HMA
on) that recomputed them. The models are built locally (tools/local_model),
tiny and random.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from test_tiers_e2e import settle
from vllm_kvbm.tools import local_model_archs
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1500)


def only_lower_tiers_keep(llm, fillers: int = 3) -> None:
    """Fresh 3000-token prompts push every page stored before out of the host
    tier (their pages and group pages outnumber its slots, LRU), then vLLM's
    own prefix cache is cleared: only the disk and remote tiers keep them."""
    settle(llm)
    for i in range(fillers):
        generate(llm, [random_prompt(3000, seed=9990 + i)], max_tokens=1)
    settle(llm)
    assert llm.reset_prefix_cache()


def hits_from_host_then_disk(llm, prompts, want, hits, fillers: int = 3) -> None:
    """``prompts`` (stored before) in one batch, vLLM's own cache cleared:
    outputs ``want`` with ``hits`` tokens from the host tier; then again
    from the disk tier once only the lower tiers keep them."""
    for tier in ("host", "disk"):
        if tier == "host":
            assert llm.reset_prefix_cache()  # vLLM's own cache only
        else:
            only_lower_tiers_keep(llm, fillers)
        before = kvbm_counter(f"matched_tokens_{tier}")
        got, cached = generate(llm, prompts)
        assert got == want and cached == hits
        assert kvbm_counter(f"matched_tokens_{tier}") - before == sum(hits)


def recomputed(plain, prompts):
    """Greedy outputs of the plain engine, its own prefix cache cleared first."""
    assert plain.reset_prefix_cache()
    return generate(plain, prompts)[0]


ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096)  # 128-token blocks, float32
LENGTHS = (129, 300, 1001, 2049)  # one page, past the window, 7 and 16 pages
# The hit of each: its full pages but the one holding its last token
HITS = [128, 256, 896, 2048]


@dataclass(frozen=True)
class Windowed:
    build: str  # tools/local_model_archs's builder
    directory: str
    # pages of 128 tokens the four prompts store, every group's together
    stored_pages: int


MODELS = {
    # every full-attention page; of each of the five sliding groups only the
    # pages in the 255 tokens (2 pages) before the prompt's last full page and
    # before every 8 pages (4 windows): 129: 1 + 5*1, 300: 2 + 5*2, 1001:
    # 7 + 5*2 (pages 5, 6), 2049: 16 + 5*4 (pages 6, 7, 14, 15). Stored whole
    # (HMA off) they would be 6 * 26 = 156.
    "gemma3": Windowed("build_gemma3", local_model_archs.GEMMA3_DIR, 6 + 12 + 17 + 36),
    # the sliding group (a 127-token window: one page) keeps the page before the
    # prompt's last full page and before every 4 pages: 129: 1 + 1, 300: 2 + 1,
    # 1001: 7 + 2 (pages 3, 6), 2049: 16 + 4 (pages 3, 7, 11, 15); whole: 52.
    # A sink-specific spec would keep the model out of KVBM: nothing stored.
    "gpt_oss": Windowed("build_gpt_oss", local_model_archs.GPT_OSS_DIR, 2 + 3 + 9 + 20),
    # each of the three chunked groups keeps the pages of the prompt's last
    # chunk before its last full page (a hit at a chunk's start reads none):
    # 129: 1 + 3*1, 300: 2 (its hit starts a chunk), 1001: 7 + 3*1 (page 6),
    # 2049: 16; whole: 4 * 26 = 104.
    "llama4": Windowed("build_llama4", local_model_archs.LLAMA4_DIR, 4 + 2 + 10 + 16),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    spec = MODELS[request.param]
    return spec, str(getattr(local_model_archs, spec.build)(ROOT / spec.directory))


@pytest.fixture(scope="module")
def plain(model, same_binding):  # noqa: F811
    llm = make_llm(None, model=model[1], **ENGINE)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvbm(model, same_binding, tmp_path_factory):  # noqa: F811
    # every page of the four prompts, and fewer than three fillers store
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=model[0].stored_pages + 16,
            disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
            disk_cache_size="256MiB",
            **EVERY_PAGE_LOADED,
        ),
        model=model[1],
        **ENGINE,
    )
    yield llm
    shutdown(llm)


def test_windowed_layers_store_only_what_hits_read_and_hits_equal_recompute(model, plain, kvbm):
    spec = model[0]
    assert kvbm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompts = [random_prompt(n, seed=9500 + n) for n in LENGTHS]
    want = recomputed(plain, prompts)
    stored = kvbm_counter("offload_blocks_d2h")
    for p, w in zip(prompts, want):  # computed one by one, stored
        assert generate(kvbm, [p])[0] == [w]
    settle(kvbm)
    assert kvbm_counter("offload_blocks_d2h") - stored == spec.stored_pages
    hits_from_host_then_disk(kvbm, prompts, want, HITS)


def test_windowed_model_growing_conversation_equals_recompute(plain, kvbm):
    """Each turn sends the last turn's prompt and answer and a new message:
    its hit is the last prompt's pages, whose last window (chunk) was stored."""
    conversation = random_prompt(700, seed=9601)
    previous = 0  # the length of the last turn's prompt
    for turn in range(3):
        want = recomputed(plain, [conversation])[0]
        assert kvbm.reset_prefix_cache()
        got, cached = generate(kvbm, [conversation])
        assert got[0] == want
        if turn:
            assert cached[0] == previous // 128 * 128
        previous = len(conversation)
        conversation = conversation + want + random_prompt(300, seed=9610 + turn)
