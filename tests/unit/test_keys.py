"""Block keys (vllm_kvbm/keys.py): what changes them (the KV would differ),
what does not (the process), and a LoRA adapter changed on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_kvbm.keys import KeyChain, KeyNamespace, LoRAIdentity, request_salt


# ---- keys --------------------------------------------------------------------

_NS = dict(
    model="m@",
    dtype="torch.float16",
    kv_layout="NHD",
    block_size=16,
    page_bytes=4096,
    tp_size=1,
    extra="",
)
_TOKENS = list(range(100, 164))


def _first_key(block_size: int = 16, salt: bytes = b"", **changes) -> bytes:
    ns = KeyNamespace(**{**_NS, "block_size": block_size, **changes})
    return KeyChain(ns.seed(), block_size, salt).extend(_TOKENS)[0]


_LORA = LoRAIdentity("lora-a", 1, "/adapters/a", "f1")


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other@"),
        dict(dtype="torch.bfloat16"),
        dict(extra="tenant-b"),
        dict(block_size=32),
        dict(kv_layout="HND"),
        dict(tp_size=2),
        # every fp8 KV cache has torch dtype uint8: vLLM's kv-cache-dtype tells them apart
        dict(kv_cache_dtype='["fp8_e5m2", []]'),
        dict(quantization="fp8"),
        dict(model_fingerprint="new-weights-same-path"),
        # the same page of 256 tokens laid out in blocks of 32 or of 64 tokens
        dict(block_size=32, page_blocks=8),
        dict(page_blocks=2),
        dict(kv_spec='{"groups": []}'),
        dict(config="another-vllm-setting"),
        dict(salt=request_salt(_LORA, None)),
        dict(salt=request_salt(None, "salt")),
    ],
)
def test_keys_differ_when_kv_would(change):
    assert _first_key(**change) != _first_key()


@pytest.mark.parametrize(
    "other",
    [
        LoRAIdentity("lora-a", 2, "/adapters/a", "f1"),  # same name, other adapter id
        LoRAIdentity("lora-a", 1, "/adapters/b", "f1"),  # same name, other path
        LoRAIdentity("lora-a", 1, "/adapters/a", "f2"),  # same path, new weights
    ],
)
def test_lora_identity_is_more_than_its_name(other):
    assert request_salt(other, None) != request_salt(_LORA, None)


def test_request_salt_encoding_is_unambiguous():
    """The old "name|salt" join made these two requests share keys."""
    a = request_salt(LoRAIdentity("x|y", 1, ""), "z")
    b = request_salt(LoRAIdentity("x", 1, ""), "y|z")
    assert a != b
    assert request_salt(None, "|") != request_salt(None, "")


def test_keys_chain_over_the_prefix():
    ns = KeyNamespace(**_NS)
    a = KeyChain(ns.seed(), 16).extend(_TOKENS)
    b = KeyChain(ns.seed(), 16).extend(_TOKENS[:16] + [0] + _TOKENS[17:])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    # Incremental extension gives the same keys as one call.
    c = KeyChain(ns.seed(), 16)
    c.extend(_TOKENS[:20])
    assert c.extend(_TOKENS) == a


def test_keys_stable_across_processes():
    code = (
        "from vllm_kvbm.keys import KeyChain, KeyNamespace\n"
        f"ns = KeyNamespace(**{_NS!r})\n"
        f"print(KeyChain(ns.seed(), 16).extend({_TOKENS!r})[-1].hex())\n"
    )
    here = KeyChain(KeyNamespace(**_NS).seed(), 16).extend(_TOKENS)[-1].hex()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run(
            [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
        assert got == here


def test_a_lora_adapter_changed_on_disk_is_no_longer_cached(tmp_path, caplog):
    """vLLM runs the adapter weights it loaded for an int id until it reloads
    them at a time the scheduler cannot see: once the files change, the
    adapter's requests are not cached (no lookup, no stores, those in flight
    store nothing more), with a warning that says how to cache it again. An
    adapter loaded under a new int id is cached."""
    import logging

    from vllm.lora.request import LoRARequest

    from helpers.scheduler_harness import fingerprinted, kvbm, make_request, make_scheduler, tokens

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"old weights")
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 91)
    first = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
    fingerprinted(k, first.lora_request)
    assert k.get_num_new_matched_tokens(first, 0) == (0, False)
    assert not k._reqs[first.request_id].no_store

    (adapter / "adapter_model.safetensors").write_bytes(b"new weights")
    fingerprinted(k, first.lora_request)  # as after the next request, in the background
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.scheduler.lora_adapters"):
        second = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
        assert k.get_num_new_matched_tokens(second, 0) == (0, False)
    assert second.request_id not in k._reqs  # not tracked: nothing looked up or stored
    assert k._reqs[first.request_id].no_store
    assert "changed on disk" in caplog.text and "new adapter name" in caplog.text
    third = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
    k.get_num_new_matched_tokens(third, 0)
    assert third.request_id not in k._reqs
    assert caplog.text.count("changed on disk") == 1  # warned once

    renamed = make_request(prompt, lora_request=LoRARequest("tuned-v2", 2, str(adapter)))
    fingerprinted(k, renamed.lora_request)
    k.get_num_new_matched_tokens(renamed, 0)
    assert not k._reqs[renamed.request_id].no_store
