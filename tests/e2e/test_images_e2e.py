"""Requests with images on a real vision-language engine: cached under vLLM's
block hashes, which name each image's content hash, so KV onboarded from the
host or disk tier equals a recompute, and the same text with another image
shares only the pages before the image.

The model is the local Idefics3 (tools/local_model_archs.build_idefics3: a small
vision tower, 16 tokens an image, and a Llama). One engine with host and disk
tiers; each reference is that engine's own recompute: a request sent with
loads and stores off through its ``kv_transfer_params``.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ROOT
from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    RECOMPUTE,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens
from test_tiers_e2e import clear_engine_and_host, settle
from vllm_kvbm.tools.local_model_archs import (
    IMAGE_SIZE,
    IMAGE_TOKEN,
    IMAGE_TOKENS,
    VL_DIR,
    build_idefics3,
)
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 16
# <fake_token_around_image><global-img>, the image's tokens, <fake_token_around_image>
PLACEHOLDER = 2 + IMAGE_TOKENS + 1
# Two full blocks of text and some of the third, where the image starts;
# text after it fills the third block and three more, and part of a sixth.
BEFORE = 2 * BLOCK_SIZE + 40
AFTER = 3 * BLOCK_SIZE + 20
LENGTH = BEFORE + PLACEHOLDER + AFTER


def image(seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(
        0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8
    )
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = build_idefics3(ROOT / VL_DIR)
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(tmp_path_factory.mktemp("disk")),
            disk_cache_size="256MiB",
            **EVERY_PAGE_LOADED,
        ),
        model=str(model),
        max_model_len=4096,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=256 << 20,
        limit_mm_per_prompt={"image": 2},
    )
    yield llm
    shutdown(llm)


def generate(llm, prompt: dict, params: dict | None = None) -> tuple[list[int], int]:
    out = generate_request(llm, prompt, params, max_tokens=12)
    assert len(out.prompt_token_ids) == LENGTH  # the image expanded to its placeholder
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_prompts_with_images_onboarded_from_host_and_disk_equal_recompute(llm):
    token = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
    ids = random_prompt(BEFORE + AFTER, seed=9401)
    text = ids[:BEFORE] + [token] + ids[BEFORE:]
    a = {"prompt_token_ids": text, "multi_modal_data": {"image": image(1)}}
    b = {"prompt_token_ids": text, "multi_modal_data": {"image": image(2)}}
    full = expected_hit_tokens(LENGTH)

    assert llm.reset_prefix_cache()
    want_a, cached = generate(llm, a, RECOMPUTE)
    assert cached == 0
    assert llm.reset_prefix_cache()  # b's first blocks are a's
    want_b, cached = generate(llm, b, RECOMPUTE)
    assert cached == 0
    # The image reaches the output: a load that mixed the images up would show.
    assert want_a != want_b
    assert llm.reset_prefix_cache()
    got, cached = generate(llm, a)  # computed, stored
    assert got == want_a and cached == 0

    assert llm.reset_prefix_cache()  # vLLM's own cache only: the host tier keeps a
    host = kvbm_counter("matched_tokens_host")
    got, cached = generate(llm, a)
    assert got == want_a
    assert cached == full
    assert kvbm_counter("matched_tokens_host") - host == full

    # The same text with another image: only the two pages before the image's block.
    assert llm.reset_prefix_cache()
    got, cached = generate(llm, b)
    assert got == want_b and cached == (BEFORE // BLOCK_SIZE) * BLOCK_SIZE

    clear_engine_and_host(llm, HOST_BLOCKS)  # only the disk keeps a now
    disk = kvbm_counter("matched_tokens_disk")
    got, cached = generate(llm, a)
    assert got == want_a and cached == full
    assert kvbm_counter("matched_tokens_disk") - disk == full
    settle(llm)
