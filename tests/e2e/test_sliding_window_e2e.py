"""A Gemma 3-shaped model (five sliding-window layers with a 256-token window,
then a full-attention layer) served by KVBM with vLLM's hybrid allocator off
(``--disable-hybrid-kv-cache-manager``: the sliding layers' KV is allocated
and stored full length, as full attention). Greedy outputs with KV onboarded
from the host and the disk tiers, in a batch, equal those of a plain engine
with vLLM's hybrid allocator on that recomputed them, at prompt lengths below,
at and well past the window.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import expected_hit_tokens, generate
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.local_model_archs import GEMMA3_DIR, build_gemma3

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 40
LENGTHS = (129, 300, 1001, 2049)  # one block, just past the window, four and eight windows
ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def gemma3():
    return str(build_gemma3(ROOT / GEMMA3_DIR))


@pytest.fixture(scope="module")
def plain(gemma3, same_binding):
    llm = make_llm(None, model=gemma3, **ENGINE)  # vLLM's hybrid allocator on
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvbm(gemma3, same_binding, tmp_path_factory):
    from vllm_kvbm.tools.server import kvbm_transfer_config

    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
            disk_cache_size="256MiB",
            **EVERY_PAGE_LOADED,
        ),
        model=gemma3,
        disable_hybrid_kv_cache_manager=True,
        **ENGINE,
    )
    yield llm
    shutdown(llm)


def test_sliding_window_model_onboarded_from_host_then_disk_equals_recompute(plain, kvbm):
    prompts = [random_prompt(n, seed=9400 + n) for n in LENGTHS]
    assert plain.reset_prefix_cache()
    want = generate(plain, prompts)[0]
    for p, w in zip(prompts, want):  # computed one by one, stored
        assert generate(kvbm, [p])[0] == [w]
    hits = [expected_hit_tokens(n) for n in LENGTHS]

    assert kvbm.reset_prefix_cache()  # vLLM's own cache only
    host = kvbm_counter("matched_tokens_host")
    got, cached = generate(kvbm, prompts)  # one batch
    assert got == want
    assert cached == hits
    assert kvbm_counter("matched_tokens_host") - host == sum(hits)

    clear_engine_and_host(kvbm, HOST_BLOCKS)  # only the disk keeps them now
    disk = kvbm_counter("matched_tokens_disk")
    got, cached = generate(kvbm, prompts)
    assert got == want and cached == hits
    assert kvbm_counter("matched_tokens_disk") - disk == sum(hits)
