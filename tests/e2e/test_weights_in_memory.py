"""Weights vLLM changes in memory, as an RL loop's weight sync does: one norm
weight of layer 1 set by a function sent through ``collective_rpc``, then
vLLM's plain ``reset_prefix_cache()`` (``reset_connector=False``). KVBM cannot
tell what a function did, so the workers move to a private label before it
runs (worker/weight_changes.py): no page of the old weights is onboarded, and
the engine's own pages under that label are found again after the next reset
(nothing changed since). A connector reset (``reset_connector=True``) only
clears the host tier: the keys name the weights, so the disk pages of the
weights the workers run are served again, and none of other weights. Weights
set back by another function stay private: KVBM cannot know they are back.
"""

from __future__ import annotations

import os

import pytest

from helpers.engines import BLOCK_SIZE, MODEL_DIR, kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import expected_hit_tokens, generate
from test_tiers_e2e import settle
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(2400)

# collective_rpc of a function (as RL frameworks send their weight syncs)
# needs pickle between vLLM's processes: set at collection, before any engine
# of the session starts.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

NORM = "model.layers.1.input_layernorm.weight"
PROMPT = random_prompt(4 * BLOCK_SIZE + 10, seed=2801)


def _get_norm() -> list[float]:
    """The norm weight as loaded, read from the checkpoint (a function sent
    through collective_rpc to read it would count as a change)."""
    from safetensors.torch import load_file

    return load_file(str(MODEL_DIR / "model.safetensors"))[NORM].float().tolist()


def _set_norm(worker, value: list[float]) -> None:
    import torch

    params = dict(worker.model_runner.get_model().named_parameters())
    params[NORM].data.copy_(torch.tensor(value, dtype=params[NORM].dtype))


def _update(llm, value) -> None:
    llm.collective_rpc(_set_norm, args=(value,))


@pytest.fixture
def updated_engine(model_dir, tmp_path):
    """An engine of its own: the test changes its weights."""
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=16, disk_cache_dir=str(tmp_path), disk_cache_size="256MiB"
        )
    )
    yield llm
    shutdown(llm)


def _recomputed(llm) -> list[int]:
    """What the engine answers from its weights alone: under a cache salt of
    its own the prompt shares no page with anything cached."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [out] = llm.generate(
        [{"prompt_token_ids": PROMPT, "cache_salt": "reference"}], params, use_tqdm=False
    )
    return list(out.outputs[0].token_ids)


def test_weights_changed_in_memory_never_meet_old_pages(updated_engine):
    llm = updated_engine
    norm = _get_norm()
    old_out, _ = generate(llm, [PROMPT])
    # The control: unchanged weights, a plain reset: the host tier serves it.
    assert llm.reset_prefix_cache()
    loaded = kvbm_counter("onboard_blocks_h2d")
    again, cached = generate(llm, [PROMPT])
    assert again == [old_out[0]] and cached[0] == expected_hit_tokens(len(PROMPT))
    assert (
        kvbm_counter("onboard_blocks_h2d") - loaded
        == expected_hit_tokens(len(PROMPT)) // BLOCK_SIZE
    )

    settle(llm)  # the old weights' pages are on disk too
    _update(llm, [2.0 * w for w in norm])
    assert llm.reset_prefix_cache()  # reset_connector=False, as RL frameworks call it
    loaded = kvbm_counter("onboard_blocks_h2d") + kvbm_counter("onboard_blocks_d2d")
    got, _ = generate(llm, [PROMPT])
    want = _recomputed(llm)
    # no old page onboarded, from either tier
    assert kvbm_counter("onboard_blocks_h2d") + kvbm_counter("onboard_blocks_d2d") == loaded
    assert got == [want]
    assert want != old_out[0]  # the change shows in the answer: old pages would have

    # The engine's own pages under its private label: stored, and found
    # again after the next reset (nothing changed since).
    assert llm.reset_prefix_cache()
    stored, _ = generate(llm, [PROMPT])
    assert stored == [want]
    assert llm.reset_prefix_cache()
    loaded = kvbm_counter("onboard_blocks_h2d")
    hit, cached = generate(llm, [PROMPT])
    assert hit == [want] and cached[0] == expected_hit_tokens(len(PROMPT))
    assert (
        kvbm_counter("onboard_blocks_h2d") - loaded
        == expected_hit_tokens(len(PROMPT)) // BLOCK_SIZE
    )

    # A connector reset (reset_connector=True) clears the host tier; the keys
    # still name the weights the workers run, so these weights' disk pages
    # are served again: engines that received the same update share them.
    settle(llm)
    assert llm.reset_prefix_cache(reset_connector=True)
    loaded = kvbm_counter("onboard_blocks_d2d")
    hit, cached = generate(llm, [PROMPT])
    assert hit == [want] and cached[0] == expected_hit_tokens(len(PROMPT))
    assert (
        kvbm_counter("onboard_blocks_d2d") - loaded
        == expected_hit_tokens(len(PROMPT)) // BLOCK_SIZE
    )

    # The weights set back to those loaded by another function, then
    # connector resets: the answer is the old one again, recomputed under a
    # new private label (KVBM cannot know the function restored them), and
    # the pages computed so serve it after the next reset.
    _update(llm, norm)
    assert llm.reset_prefix_cache(reset_connector=True)
    back, _ = generate(llm, [PROMPT])
    assert back == [old_out[0]]
    settle(llm)
    assert llm.reset_prefix_cache(reset_connector=True)
    back, cached = generate(llm, [PROMPT])
    assert back == [old_out[0]] and cached[0] == expected_hit_tokens(len(PROMPT))
