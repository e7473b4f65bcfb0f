"""A LoRA adapter rewritten in place on a real engine.

vLLM loads an adapter's files once per int id and keeps running those
weights until it evicts them or a request asks ``load_inplace``; KVBM cannot
see either happen. So once the files change (fingerprints.adapter_fingerprint,
stat-keyed, checked after each request on the adapter thread), the adapter is
not cached again in that engine: no lookups, no stores. Without that, a request
between the rewrite and vLLM's reload stored the old weights' KV under the new
files' keys, and the reloaded adapter's next request onboarded it.

The adapter (k_proj of every layer, so it changes the KV) is written as PEFT
writes it: adapter_config.json and adapter_model.safetensors. Rewriting it in
place keeps the names, sizes, inode and (set back) mtime; vLLM reloads it on a
request with ``load_inplace=True`` (as ``/v1/load_lora_adapter`` does).
"""

from __future__ import annotations

import json
import os

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    MODEL_DIR,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 16
RANK = 8
PROMPT = random_prompt(5 * BLOCK_SIZE + 7, seed=7401)
LORA_ARGS = dict(enable_lora=True, max_lora_rank=RANK, max_loras=1)


def write_adapter(path, seed: int) -> None:
    import torch
    from safetensors.torch import save

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv_dim = cfg["num_key_value_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        name = f"base_model.model.model.layers.{i}.self_attn.k_proj"
        tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.2
        tensors[f"{name}.lora_B.weight"] = torch.randn(kv_dim, RANK, generator=gen) * 0.2
    os.makedirs(path, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "target_modules": ["k_proj"],
                "bias": "none",
                "lora_dropout": 0.0,
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
                "modules_to_save": None,
                "base_model_name_or_path": str(MODEL_DIR),
            }
        )
    )
    data = save(tensors)
    weights = path / "adapter_model.safetensors"
    if weights.exists():
        st = os.stat(weights)
        assert len(data) == st.st_size
        with open(weights, "r+b") as f:  # in place: same inode
            f.write(data)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(weights).st_ino == st.st_ino
    else:
        weights.write_bytes(data)


def generate(llm, lora, max_tokens: int = 16):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=lora, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _step(llm) -> None:
    """One engine step that stores nothing (no full block)."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [7] * 8}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_lora_rewritten_in_place_is_no_longer_cached(tmp_path, monkeypatch, model_dir):
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    adapter = tmp_path / "adapter"
    write_adapter(adapter, seed=1)
    disk = tmp_path / "disk"
    disk.mkdir()
    config = kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk),
        disk_cache_size="1GiB",
        **EVERY_PAGE_LOADED,
    )
    lora = LoRARequest("tuned", 1, str(adapter))

    kvbm = make_llm(config, **LORA_ARGS)
    try:
        # An adapter's first request is a miss: its files are fingerprinted on
        # a thread of their own, never on vLLM's scheduler thread
        # (scheduler/adapter_fingerprints.py); the next one is stored.
        old_out, _ = generate(kvbm, lora)
        clear_engine_and_host(kvbm, HOST_BLOCKS)
        assert generate(kvbm, lora)[0] == old_out
        clear_engine_and_host(kvbm, HOST_BLOCKS)
        # The control: the old adapter's pages are found on disk.
        disk_hits = kvbm_counter("matched_tokens_disk")
        again, cached = generate(kvbm, lora)
        assert again == old_out and cached == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("matched_tokens_disk") - disk_hits == cached

        write_adapter(adapter, seed=2)  # new weights, same names, sizes, inode, mtime
        # vLLM's own prefix cache names an adapter by name and path only: it
        # would serve the old adapter's blocks itself, so it is cleared here.
        assert kvbm.reset_prefix_cache()
        stored = kvbm_counter("offload_blocks_d2h")
        # vLLM still runs the weights it loaded for id 1: the old answer, which
        # must not be stored under the new files' keys. Its keys name the files
        # as the adapter thread last saw them (the old ones: their pages are
        # those weights'); it looks at them again now...
        stale, _ = generate(kvbm, lora)
        assert stale == old_out
        assert kvbm.reset_prefix_cache()
        # ...or the reloaded adapter would onboard it here.
        got = _reload_onboards_nothing(kvbm, adapter)
        assert kvbm_counter("offload_blocks_d2h") == stored
    finally:
        shutdown(kvbm)
    _assert_recomputed_with_the_new_files(got, old_out)


def _reload_onboards_nothing(kvbm, adapter) -> list[int]:
    """vLLM reloads the rewritten adapter (``load_inplace``, as
    ``/v1/load_lora_adapter`` does): KVBM finds nothing for it."""
    from vllm.lora.request import LoRARequest

    matched = kvbm_counter("matched_tokens")
    got, cached = generate(kvbm, LoRARequest("tuned", 1, str(adapter), load_inplace=True))
    assert cached == 0
    assert kvbm_counter("matched_tokens") == matched
    return got


def _assert_recomputed_with_the_new_files(got: list[int], old_out: list[int]) -> None:
    """``got`` was recomputed (nothing matched) with the adapter's files as
    they are now, and differs from the old weights' answer: old pages served
    would have shown."""
    assert got != old_out


def test_lora_loaded_then_rewritten_before_its_first_request_stores_nothing(
    tmp_path, monkeypatch, model_dir
):
    """vLLM reads an adapter's files when it is loaded (``/v1/load_lora_adapter``,
    here ``add_lora``), the scheduler when its first request arrives: files
    rewritten in between make the keys name the new weights while vLLM runs
    the old. The workers see what vLLM loaded (worker/lora_loads.py) and
    refuse the stores; the reloaded adapter then finds nothing to onboard."""
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    adapter = tmp_path / "adapter"
    write_adapter(adapter, seed=1)
    config = kvbm_transfer_config(host_cache_blocks=HOST_BLOCKS)
    kvbm = make_llm(config, **LORA_ARGS)
    try:
        assert kvbm.llm_engine.add_lora(LoRARequest("tuned", 1, str(adapter)))
        write_adapter(adapter, seed=2)  # new weights, same names, sizes, inode, mtime
        stored = kvbm_counter("offload_blocks_d2h")
        old_out, cached = generate(kvbm, LoRARequest("tuned", 1, str(adapter)))
        assert cached == 0
        _step(kvbm)  # collects the stores' results
        assert kvbm_counter("offload_blocks_d2h") == stored  # the old weights' KV: refused
        assert kvbm.reset_prefix_cache()  # vLLM's own cache names the adapter by id only
        got = _reload_onboards_nothing(kvbm, adapter)
    finally:
        shutdown(kvbm)
    _assert_recomputed_with_the_new_files(got, old_out)
