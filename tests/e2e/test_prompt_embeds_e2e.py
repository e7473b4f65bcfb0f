"""Prompt embeddings on a real engine: cached under vLLM's block hashes, which
name the embeddings' values, so onboarded KV equals a recompute and two
prompts that differ in one embedding share only the pages before it.

The embeddings are rows of the local model's own embedding matrix (what a
client computing them would send). One engine (``--enable-prompt-embeds``,
host and disk tiers); the reference is that engine's own recompute: a
request sent with loads and stores off through its ``kv_transfer_params``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    MODEL_DIR,
    RECOMPUTE,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens
from test_tiers_e2e import clear_engine_and_host, settle
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 16
LENGTH = 3 * BLOCK_SIZE + 20


def embeddings(token_ids: list[int]) -> torch.Tensor:
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[torch.tensor(token_ids)].to(torch.float32).contiguous()


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
            disk_cache_size="256MiB",
            **EVERY_PAGE_LOADED,
        ),
        enable_prompt_embeds=True,
    )
    yield llm
    shutdown(llm)


def generate(llm, embeds: torch.Tensor, params: dict | None = None) -> tuple[list[int], int]:
    out = generate_request(llm, {"prompt_embeds": embeds}, params)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_prompt_embeddings_onboarded_from_host_and_disk_equal_recompute(llm):
    ids = random_prompt(LENGTH, seed=9301)
    e = embeddings(ids)
    f = e.clone()
    f[2 * BLOCK_SIZE + 7] = embeddings([ids[0] + 1])[0]  # one position of the third block

    assert llm.reset_prefix_cache()
    want_f, cached = generate(llm, f, RECOMPUTE)
    assert cached == 0
    assert llm.reset_prefix_cache()  # f's first blocks are e's
    want_e, cached = generate(llm, e)  # computed, stored
    assert cached == 0

    assert llm.reset_prefix_cache()  # vLLM's own cache only: the host tier keeps e
    host = kvbm_counter("matched_tokens_host")
    got, cached = generate(llm, e)
    assert got == want_e
    assert cached == expected_hit_tokens(LENGTH)
    assert kvbm_counter("matched_tokens_host") - host == expected_hit_tokens(LENGTH)

    # f equals e up to its third block: only the two pages before it are shared.
    assert llm.reset_prefix_cache()
    got, cached = generate(llm, f)
    assert got == want_f and cached == 2 * BLOCK_SIZE

    # The same ids as token ids: other keys (vLLM hashes the embeddings, not ids).
    assert llm.reset_prefix_cache()
    matched = kvbm_counter("matched_tokens")
    out = llm.generate([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and kvbm_counter("matched_tokens") == matched

    clear_engine_and_host(llm, HOST_BLOCKS)  # only the disk keeps e now
    disk = kvbm_counter("matched_tokens_disk")
    got, cached = generate(llm, e)
    assert got == want_e and cached == expected_hit_tokens(LENGTH)
    assert kvbm_counter("matched_tokens_disk") - disk == expected_hit_tokens(LENGTH)
    settle(llm)
