"""A Qwen3-Next-shaped hybrid (Gated DeltaNet layers beside full attention)
starts with KVBMConnector and answers like a plain engine.

The connector subclasses SupportsHMA, so vLLM keeps its hybrid KV cache
manager on (without it this model stops at startup: "Failed to promote local
KV cache specs to one unified type"). KVBM keeps a model of several KV cache
groups out of its tiers for now: no hit comes from it and nothing is stored,
while vLLM's own prefix cache still serves the repeated prompt.

The model is built locally (tools/local_model.build_qwen3_next), tiny and in
bf16: vLLM's CPU build runs GDN layers in bf16 only, where bf16 may be
emulated, so the prompt is short.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import (BLOCK_SIZE, kvbm_counter, make_llm, random_prompt, shutdown,
                             vllm_counter)
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from vllm_kvbm.tools.local_model import HYBRID_DIR, build_qwen3_next
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

HYBRID = dict(dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=1024,
              kv_cache_memory_bytes=256 << 20)
# two full blocks and a partial one
LENGTH = 2 * BLOCK_SIZE + 17


@pytest.fixture(scope="module")
def hybrid_dir():
    return build_qwen3_next(ROOT / HYBRID_DIR)


@pytest.fixture(scope="module")
def plain_hybrid(hybrid_dir, same_binding):  # noqa: F811
    llm = make_llm(None, model=str(hybrid_dir), **HYBRID)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def kvbm_hybrid(hybrid_dir, same_binding):  # noqa: F811
    llm = make_llm(kvbm_transfer_config(host_cache_blocks=8), model=str(hybrid_dir), **HYBRID)
    yield llm
    shutdown(llm)


def test_a_gdn_hybrid_starts_with_kvbm_and_answers_like_a_plain_engine(plain_hybrid,
                                                                       kvbm_hybrid):
    # vLLM kept its hybrid allocator on for the connector
    config = kvbm_hybrid.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompt = random_prompt(LENGTH, seed=29)
    # run twice on each: the second finds the prefix in vLLM's own cache
    want = [generate(plain_hybrid, [prompt])[0] for _ in range(2)]

    matched = kvbm_counter("matched_tokens")
    stored = kvbm_counter("offload_blocks_d2h")
    external = vllm_counter("vllm:external_prefix_cache_hits")
    got, cached = [], []
    for _ in range(2):
        tokens, num_cached = generate(kvbm_hybrid, [prompt])
        got.append(tokens)
        cached.append(num_cached[0])

    assert got == want
    assert cached[1] > 0  # vLLM's own prefix cache still works
    # KVBM served nothing and stored nothing for this model
    assert kvbm_counter("matched_tokens") == matched
    assert kvbm_counter("offload_blocks_d2h") == stored
    assert vllm_counter("vllm:external_prefix_cache_hits") == external
