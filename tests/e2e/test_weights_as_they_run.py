"""Weights changed in memory through vLLM's own calls, on real engines: the
keys name the weights as they run (worker/weight_changes.py,
worker/loaded_weights.py), so no page of other weights is ever onboarded.

- ``reload_weights`` of a checkpoint that differs in one attention
  projection, then vLLM's plain ``reset_prefix_cache()``: the answer is a
  fresh engine's on the new checkpoint (on vLLM's CPU build the linear layers
  run from packed copies outside the parameters, so a digest of the
  parameters does not see such a reload: what was loaded labels it). A
  reload of the checkpoint loaded at startup gives its pages back.
- A function sent through ``collective_rpc`` that changes one norm weight,
  with no reset after (an RL loop that forgets it): what the engine computes
  then is not filed under the checkpoint's keys, so a fresh engine on the
  unchanged checkpoint and the same disk directory loads none of it.
"""

from __future__ import annotations

import os
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

# collective_rpc of a function needs pickle between vLLM's processes: set at
# collection, before any engine of the session starts.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPT = random_prompt(2100, seed=3101)  # 16 pages, 2048 tokens of them loadable
PROMPT_B = random_prompt(2100, seed=3102)
PAGES = expected_hit_tokens(len(PROMPT)) // BLOCK_SIZE


def _loaded() -> float:
    """vLLM blocks onboarded, from whichever tier."""
    return kvbm_counter("onboard_blocks_h2d")


def _recomputed(llm, prompt) -> list[int]:
    """The engine's answer from its weights alone: under a cache salt of its
    own the prompt shares no page with anything cached."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [out] = llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": "reference"}], params, use_tqdm=False
    )
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dir):
    """The test model's checkpoint, and a copy whose one k_proj differs."""
    root = tmp_path_factory.mktemp("checkpoints")
    orig, new = root / "orig", root / "new"
    shutil.copytree(MODEL_DIR, orig)
    shutil.copytree(MODEL_DIR, new)
    rewrite_one_tensor_in_place(new / "model.safetensors")
    return str(orig), str(new)


def _kvbm(model: str, disk) -> object:
    return make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(disk),
            disk_cache_size="1GiB",
            **EVERY_PAGE_LOADED,
        ),
        model=model,
    )


class Engines:
    """The module's engines, each started when first asked for: the one on
    the checkpoint whose weights are reloaded, and a fresh one on the new
    checkpoint (the first test's reference; the second test changes its
    weights and stops it before another engine opens its disk directory)."""

    def __init__(self, checkpoints, root):
        self.checkpoints, self.root, self.llms = checkpoints, root, {}

    def get(self, name: str):
        if name not in self.llms:
            model = self.checkpoints[0] if name == "orig" else self.checkpoints[1]
            self.llms[name] = _kvbm(model, self.disk(name))
        return self.llms[name]

    def disk(self, name: str):
        path = self.root / f"disk-{name}"
        path.mkdir(exist_ok=True)
        return path

    def stop(self, name: str) -> None:
        shutdown(self.llms.pop(name))


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    held = Engines(checkpoints, tmp_path_factory.mktemp("disks"))
    yield held
    for name in list(held.llms):
        held.stop(name)


def test_reload_weights_then_a_reset_answers_as_a_fresh_engine_on_the_new_checkpoint(
    engines, checkpoints
):
    orig, new = checkpoints
    # A fresh engine on the new checkpoint answers first: the engine started
    # last owns the metrics this process reads (each start unregisters the
    # previous engine's).
    want = _recomputed(engines.get("new"), PROMPT)
    llm = engines.get("orig")
    old_out, _ = generate(llm, [PROMPT])  # its pages stored under the checkpoint's keys

    llm.collective_rpc("reload_weights", kwargs={"weights_path": new})
    assert llm.reset_prefix_cache()  # reset_connector=False, as RL frameworks call it
    loaded = _loaded()
    got, cached = generate(llm, [PROMPT])
    assert _loaded() == loaded and cached == [0]  # no page of the weights before
    assert got == [want]
    assert want != old_out[0]  # the new k_proj shows in the answer: old pages would have

    # What the reload loaded labels the pages. The request above was keyed
    # before the workers' labels were in (its jobs refused); once they are,
    # pages are stored under them and found again after a reset.
    assert llm.reset_prefix_cache()
    stored, _ = generate(llm, [PROMPT])
    assert stored == [want]
    assert llm.reset_prefix_cache()
    loaded = _loaded()
    again, cached = generate(llm, [PROMPT])
    assert again == [want] and cached == [expected_hit_tokens(len(PROMPT))]
    assert _loaded() - loaded == PAGES

    # The checkpoint loaded at startup again: its label, and the first run's
    # pages (in the host or the disk tier) serve it.
    llm.collective_rpc("reload_weights", kwargs={"weights_path": orig})
    assert llm.reset_prefix_cache()
    back, _ = generate(llm, [PROMPT])  # keyed before the labels are in: recomputed
    assert back == old_out
    assert llm.reset_prefix_cache()
    loaded = _loaded()
    back, cached = generate(llm, [PROMPT])
    assert back == old_out and cached == [expected_hit_tokens(len(PROMPT))]
    assert _loaded() - loaded == PAGES


def _add_one_to_a_norm(worker) -> None:
    params = dict(worker.model_runner.get_model().named_parameters())
    params["model.layers.1.input_layernorm.weight"].data.add_(1)


def test_a_weight_change_without_a_reset_never_reaches_another_engine(engines, checkpoints):
    new = checkpoints[1]
    llm = engines.get("new")
    llm.collective_rpc(_add_one_to_a_norm)  # no reset after
    changed, _ = generate(llm, [PROMPT_B])
    settle(llm)  # its write-through to disk landed
    engines.stop("new")

    fresh = _kvbm(new, engines.disk("new"))  # nothing wrong done: the unchanged checkpoint
    try:
        matched, loaded = kvbm_counter("matched_tokens_disk"), _loaded()
        got, cached = generate(fresh, [PROMPT_B])
        assert cached == [0]
        assert kvbm_counter("matched_tokens_disk") == matched and _loaded() == loaded
        want = _recomputed(fresh, PROMPT_B)
    finally:
        shutdown(fresh)
    assert got == [want]
    assert changed != got  # the change shows in the answer: its pages would have
