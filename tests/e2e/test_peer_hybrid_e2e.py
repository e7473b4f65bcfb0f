"""A hybrid model's prefix read from a peer's pool: a Gemma 3-shaped model
(sliding-window and full-attention layers, vLLM's hybrid allocator on), whose
pages are kept per KV cache group (scheduler/group_pages.py). Engine A computes
the prompts and keeps every group's pages in its pool; engine B, told by a
router's hint that A holds them, reads the prefix's full-attention pages and
each sliding group's window pages out of A's memory over NIXL and onboards
them: greedy outputs equal a plain engine's (hybrid allocator on) recompute.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import (
    EVERY_PAGE_LOADED,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from test_hybrid_window_e2e import ENGINE, HITS, LENGTHS, recomputed
from test_peer_e2e import hint, port, settle, shm  # noqa: F401 (port, shm: fixtures)
from vllm_kvbm.tools import local_model_archs
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def gemma3():
    return str(local_model_archs.build_gemma3(ROOT / local_model_archs.GEMMA3_DIR))


@pytest.fixture(scope="module")
def plain(gemma3, same_binding):  # noqa: F811
    llm = make_llm(None, model=gemma3, **ENGINE)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def engine_a(gemma3, shm, port, same_binding):  # noqa: F811
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=96,
            pool_cache_size="512MiB",
            pool_dir=shm,
            pool_serve_port=port,
            pool_serve_host="127.0.0.1",
            **EVERY_PAGE_LOADED,
        ),
        model=gemma3,
        **ENGINE,
    )
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def engine_b(gemma3, engine_a, same_binding):  # noqa: F811
    llm = make_llm(
        kvbm_transfer_config(host_cache_blocks=96, peer_reads=True, **EVERY_PAGE_LOADED),
        model=gemma3,
        **ENGINE,
    )
    yield llm
    shutdown(llm)


def test_a_hybrid_prefix_is_read_group_by_group_from_a_peers_pool(plain, engine_a, engine_b, port):  # noqa: F811
    assert engine_b.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompts = [random_prompt(n, seed=9400 + n) for n in LENGTHS]
    want = recomputed(plain, prompts)
    for p, w in zip(prompts, want):  # computed by A, one by one: every group's pages kept
        assert generate(engine_a, [p])[0] == [w]
    settle(engine_a)
    matched = kvbm_counter("matched_tokens_peer")
    for p, w, hit in zip(prompts, want, HITS):
        out = generate_request(engine_b, {"prompt_token_ids": p}, hint(port))
        assert list(out.outputs[0].token_ids) == w
        assert out.num_cached_tokens == hit
    assert kvbm_counter("matched_tokens_peer") - matched == sum(HITS)
