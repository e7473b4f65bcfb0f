"""A hybrid model at tensor parallelism 2: the Gemma 3-shaped model of
test_hybrid_window_e2e (five sliding-window layers with a 256-token window,
then a full-attention layer; float32, 4 query and 2 KV heads: one KV head a
rank) with vLLM's hybrid allocator (HMA) on. Each rank stores and loads its
own shard of every group's pages; greedy outputs with KV onboarded from the
host tier and from the disk tier, in a batch, equal those of a plain TP=2
engine (HMA on) that computed every prompt. vLLM CPU runs TP=2 with one core
per rank (VLLM_CPU_OMP_THREADS_BIND='0|1'), both engines bound alike.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import generate
from test_hybrid_window_e2e import HITS, LENGTHS, MODELS, hits_from_host_then_disk
from test_tiers_e2e import settle
from test_tp_e2e import tp_env  # noqa: F401 (a fixture: one core per rank)
from vllm_kvbm.tools.local_model_archs import GEMMA3_DIR, build_gemma3
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

TP = 2
ENGINE = dict(
    tensor_parallel_size=TP,
    kv_cache_memory_bytes=256 << 20,
    max_model_len=4096,
    max_num_batched_tokens=4096,
)  # 128-token blocks, float32
STORED_PAGES = MODELS["gemma3"].stored_pages  # as at TP=1: each rank a shard of each page
PROMPTS = [random_prompt(n, seed=9200 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def gemma3():
    return str(build_gemma3(ROOT / GEMMA3_DIR))


@pytest.fixture(scope="module")
def want(gemma3, tp_env):  # noqa: F811
    """Greedy tokens of a plain TP=2 engine (HMA on) that computes every
    prompt; stopped before the KVBM engine starts (two TP=2 engines at once
    would share two cores four ways)."""
    llm = make_llm(None, model=gemma3, **ENGINE)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        return generate(llm, PROMPTS)[0]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def tp_kvbm(gemma3, tp_env, want, tmp_path_factory):  # noqa: F811
    disk = tmp_path_factory.mktemp("disk")
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=STORED_PAGES + 16,
            disk_cache_dir=str(disk),
            disk_cache_size="256MiB",
            **EVERY_PAGE_LOADED,
        ),
        model=gemma3,
        **ENGINE,
    )
    yield llm, disk
    shutdown(llm)


def test_tp2_sliding_window_model_host_and_disk_hits_equal_recompute(tp_kvbm, want):
    llm, disk = tp_kvbm
    assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    stored = kvbm_counter("offload_blocks_d2h")
    for p, w in zip(PROMPTS, want):  # computed one by one, stored
        assert generate(llm, [p])[0] == [w]
    settle(llm)
    # Pages counted once for both ranks: the same windows as at TP=1
    assert kvbm_counter("offload_blocks_d2h") - stored == STORED_PAGES
    # and written through to disk by each rank, its own shard of each
    files = [p.name for p in disk.glob("*.pt")]
    for rank in range(TP):
        assert len([f for f in files if f"@{TP}@{rank}@" in f]) == STORED_PAGES

    hits_from_host_then_disk(llm, PROMPTS, want, HITS)  # one batch each
