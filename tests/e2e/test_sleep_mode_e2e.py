"""vLLM's sleep mode as RL frameworks call it (verl, OpenRLHF), on a real
engine with KVBM's host and disk tiers: ``llm.sleep(level)``, ``llm.wake_up()``,
new weights loaded through ``collective_rpc``, ``reset_prefix_cache()``.

On vLLM's CPU build the worker's sleep frees nothing, but everything around
it is real: the engine core's pause, vLLM's prefix-cache reset with the
connector's, the worker's sleep and wake_up calls that KVBM follows. vLLM's
ModelConfig refuses sleep mode on CPU ("Sleep mode is not supported on
current platform"); that check runs in the front-end (this process) only,
so the test lets it through here.

- A level-1 sleep keeps the weights: pages stored before it are onboarded
  after wake-up from the host tier (the pause's reset keeps it) and, once an
  explicit reset cleared the host tier, from disk; answers equal a plain
  engine's.
- A level-2 sleep, then a load of other weights and a reset: nothing of the
  weights before is onboarded, answers equal a plain engine on the new
  weights, and the new weights' pages hit again after a level-1 sleep.
"""

from __future__ import annotations

import shutil

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    HOST_BLOCKS,
    MODEL_DIR,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate
from test_tiers_e2e import settle
from test_weights_identity import rewrite_one_tensor_in_place
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1800)

PROMPT = random_prompt(2100, seed=3301)  # 16 pages, 2048 tokens of them loadable
HIT = expected_hit_tokens(len(PROMPT))
PAGES = HIT // BLOCK_SIZE


def _loaded() -> float:
    return kvbm_counter("onboard_blocks_h2d")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dir):
    """The test model's checkpoint, and a copy whose one k_proj differs."""
    root = tmp_path_factory.mktemp("checkpoints")
    orig, new = root / "orig", root / "new"
    shutil.copytree(MODEL_DIR, orig)
    shutil.copytree(MODEL_DIR, new)
    rewrite_one_tensor_in_place(new / "model.safetensors")
    return str(orig), str(new)


@pytest.fixture(scope="module")
def plain(checkpoints, plain_llm):
    """A plain engine's answer (no KVBM, no sleep) on each checkpoint, before
    the KVBM engine starts (the engine started last owns the metrics read).
    The original checkpoint is the test model's, byte for byte: the session's
    plain engine answers for it (one engine start fewer)."""
    assert plain_llm.reset_prefix_cache()  # recomputed, as the fresh engine would
    answers = {"orig": generate(plain_llm, [PROMPT])[0][0]}
    llm = make_llm(None, model=checkpoints[1])
    try:
        answers["new"] = generate(llm, [PROMPT])[0][0]
    finally:
        shutdown(llm)
    assert answers["orig"] != answers["new"]  # the changed k_proj shows in the answer
    return answers


@pytest.fixture(scope="module")
def llm(checkpoints, plain, tmp_path_factory):
    from vllm.platforms import current_platform

    disk = tmp_path_factory.mktemp("disk")
    config = kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk),
        disk_cache_size="1GiB",
        **EVERY_PAGE_LOADED,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
        engine = make_llm(config, model=checkpoints[0], enable_sleep_mode=True)
    yield engine
    shutdown(engine)


def test_pages_stored_before_a_level_1_sleep_are_onboarded_after_wake_up(llm, plain):
    first, _ = generate(llm, [PROMPT])
    assert first == [plain["orig"]]
    settle(llm)  # its write-through to disk landed
    llm.sleep(level=1)
    assert llm.wake_up()
    host, loaded = kvbm_counter("matched_tokens_host"), _loaded()
    got, cached = generate(llm, [PROMPT])
    assert got == [plain["orig"]] and cached == [HIT]
    assert kvbm_counter("matched_tokens_host") - host == HIT and _loaded() - loaded == PAGES

    # An explicit reset of the connector clears the host tier (a pause's
    # reset does not): after the next sleep the pages come from disk.
    assert llm.reset_prefix_cache(reset_connector=True)
    llm.sleep(level=1)
    assert llm.wake_up()
    host, disk, loaded = (
        kvbm_counter("matched_tokens_host"),
        kvbm_counter("matched_tokens_disk"),
        _loaded(),
    )
    got, cached = generate(llm, [PROMPT])
    assert got == [plain["orig"]] and cached == [HIT]
    assert kvbm_counter("matched_tokens_host") == host
    assert kvbm_counter("matched_tokens_disk") - disk == HIT and _loaded() - loaded == PAGES


def test_after_a_level_2_sleep_and_new_weights_nothing_of_the_old_ones_is_onboarded(
    llm, plain, checkpoints
):
    orig, new = checkpoints
    generate(llm, [PROMPT])  # the weights loaded at startup: their pages stored
    settle(llm)
    llm.sleep(level=2)  # the weights dropped...
    assert llm.wake_up()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": new})  # ...and new ones loaded
    assert llm.reset_prefix_cache()  # reset_connector=False, as RL frameworks call it
    loaded = _loaded()
    got, cached = generate(llm, [PROMPT])
    assert cached == [0] and _loaded() == loaded  # no page of the weights before
    assert got == [plain["new"]]

    # The new weights' pages are keyed by what was loaded, and survive a
    # level-1 sleep as the first ones did.
    assert llm.reset_prefix_cache()
    stored, _ = generate(llm, [PROMPT])
    assert stored == [plain["new"]]
    llm.sleep(level=1)
    assert llm.wake_up()
    loaded = _loaded()
    again, cached = generate(llm, [PROMPT])
    assert again == [plain["new"]] and cached == [HIT] and _loaded() - loaded == PAGES
