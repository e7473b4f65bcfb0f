"""Block keys from vLLM's own block hashes (keys.VllmHashKeys), and when not.

Driven by vLLM's real Scheduler (scheduler_harness), whose requests carry the
block hashes vLLM's engine core computes (sha256 at the block size unless a
test says otherwise). Keys from vLLM's hashes must differ wherever the KV
would (namespace, LoRA, cache salt, the weights the workers run), be the same
across processes and restarts, and give way to our own chain wherever vLLM's
hashes are not reproducible or not at our blocks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256, sha256_cbor, xxhash
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

from helpers.scheduler_harness import (
    BLOCK,
    _model_dir,
    keys_of,
    kvbm,
    load_again,
    make_request,
    make_scheduler,
    step_with_weights,
    tokens,
)
from vllm_kvbm.keys import KeyChain, VllmHashKeys, vllm_key_mask, xor_keys
from vllm_kvbm.worker.loaded_weights import LoadedWeights

ROOT = Path(__file__).resolve().parents[2]


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def chain_keys(sched, toks: list[int], salt: bytes = b"") -> list[bytes]:
    return KeyChain(kvbm(sched)._seed, BLOCK, salt).extend(toks)


def test_keys_are_vllms_block_hashes_xor_a_namespace_digest(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.connector"):
        s = make_scheduler()
    assert any(
        "block keys from vLLM's sha256 block hashes" in r.getMessage() for r in caplog.records
    )
    k = kvbm(s)
    prompt = tokens(40 * BLOCK + 3, 1)
    req = make_request(prompt)
    chain = k.key_chain(req)
    assert isinstance(chain, VllmHashKeys)
    mask = vllm_key_mask(k._seed, b"", "sha256")
    want = [xor(h, mask) for h in req.block_hashes]
    assert len(want) == 40
    chain.extend_to(prompt, 5)  # on demand, in any increments
    assert chain.keys == want[:5]
    assert chain.extend(prompt) == want
    # Apart from the chain's keys for the same blocks.
    assert not set(want) & set(chain_keys(s, prompt))
    # And the scheduler stores and loads under them.
    _, load = load_again(s, tokens(3 * BLOCK + 5, 2))
    assert [k.host._entries[key].slot for key in keys_of(s, tokens(3 * BLOCK + 5, 2))] == load.slots


def test_keys_differ_across_namespaces_salts_and_weights(tmp_path):
    prompt = tokens(6 * BLOCK, 3)
    s, same, other = make_scheduler(), make_scheduler(), make_scheduler(namespace="tenant-b")
    k = kvbm(s)
    assert keys_of(s, prompt) == keys_of(same, prompt)  # same engine, same keys

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    lora = LoRARequest("lora-a", 1, str(adapter))

    def keys(**fields):
        req = make_request(prompt, **fields)
        chain = k.key_chain(req)
        assert isinstance(chain, VllmHashKeys)
        return chain.extend(prompt)

    variants = {
        "plain": keys(),
        "other namespace": keys_of(other, prompt),
        "cache salt a": keys(cache_salt="a"),
        "cache salt b": keys(cache_salt="b"),
        "lora": keys(lora_request=lora),
        # vLLM's hash names a LoRA by name and path; ours by its id and files too
        "lora, other id": keys(lora_request=LoRARequest("lora-a", 2, str(adapter))),
    }
    # A reset under the same weights keeps the keys; other weights move them.
    assert s.reset_prefix_cache(reset_connector=True)
    assert keys() == variants["plain"]
    step_with_weights(s, [LoadedWeights(0, None)])  # a worker reporting other weights
    variants["other weights"] = keys()
    variants["chain"] = chain_keys(s, prompt)
    every = [key for ks in variants.values() for key in ks]
    assert all(len(ks) == 6 for ks in variants.values())
    assert len(set(every)) == len(every), "two variants share a key"


_PRINT_KEYS = """
import json, sys
sys.path.insert(0, "tests")
from helpers.scheduler_harness import kvbm, make_request, make_scheduler, tokens
k = kvbm(make_scheduler(model=sys.argv[1]))
prompt = tokens(20 * 16 + 7, 5)
req = make_request(prompt)
chain = k.key_chain(req)
print(json.dumps([type(chain).__name__, [key.hex() for key in chain.extend(prompt)],
                  [h.hex() for h in req.block_hashes]]))
"""


def test_keys_are_the_same_across_processes_and_restarts(tmp_path):
    """Fresh processes (an engine restart) give the same keys; PYTHONHASHSEED
    moves vLLM's root hash, so it gives other keys (misses, never a clash)."""
    model = tmp_path / "model"  # one model path for all: it is in the namespace
    model.mkdir()
    for name in ("config.json", "model.safetensors"):  # a model KVBM can key by its files
        (model / name).write_bytes((Path(_model_dir()) / name).read_bytes())
    base = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    envs = [base, base, {**base, "PYTHONHASHSEED": "7"}]
    env_path = f"{ROOT}{os.pathsep}{base.get('PYTHONPATH', '')}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PRINT_KEYS, str(model)],
            cwd=ROOT,
            text=True,
            env={**env, "PYTHONPATH": env_path},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for env in envs
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [kind for kind, _, _ in results] == ["VllmHashKeys"] * 3
    (first, hashes), (restarted, rehashes), (seeded, seeded_hashes) = (
        (keys, hashes) for _, keys, hashes in results
    )
    assert len(first) == 20 and first == restarted and hashes == rehashes
    assert seeded_hashes != hashes and not set(seeded) & set(first)


def test_xxhash_keeps_our_own_chain(caplog):
    """xxhash is not collision resistant and vLLM seeds it per process: the
    keys come from our chain, whatever the requests' hashes."""
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.connector"):
        s = make_scheduler(hash_algo="xxhash")
    assert any(
        "own SHA-256 chain" in r.getMessage() and "xxhash" in r.getMessage() for r in caplog.records
    )
    k = kvbm(s)
    assert k._vllm_hashes is None
    prompt = tokens(5 * BLOCK + 1, 6)
    req = make_request(prompt, block_hasher=get_request_block_hasher(BLOCK, xxhash))
    chain = k.key_chain(req)
    assert isinstance(chain, KeyChain) and chain.extend(prompt) == chain_keys(s, prompt)


def test_a_request_whose_hashes_are_not_at_our_blocks_keeps_the_chain():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(5 * BLOCK + 1, 7)
    k.key_chain(make_request(prompt))  # the source is checked on a plain request first
    for hasher in (
        None,
        get_request_block_hasher(BLOCK // 2, sha256),
        get_request_block_hasher(BLOCK * 2, sha256),
    ):
        chain = k.key_chain(make_request(prompt, block_hasher=hasher))
        assert isinstance(chain, KeyChain) and chain.extend(prompt) == chain_keys(s, prompt)
    assert isinstance(k.key_chain(make_request(prompt)), VllmHashKeys)


def test_sha256_cbor_gives_keys_from_vllms_hashes_too():
    """vLLM's other SHA-256 hashing: checked by the same probe at the first
    request, keys apart from the sha256 engine's (the algorithm is in D)."""
    cbor = make_scheduler(hash_algo="sha256_cbor")
    plain = make_scheduler()
    prompt = tokens(4 * BLOCK, 8)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    # vLLM's root is still the harness's sha256 one: not this engine's
    assert isinstance(kvbm(cbor).key_chain(make_request(prompt, block_hasher=hasher)), KeyChain)
    init_none_hash(sha256_cbor)  # as vLLM's engine core does for this engine
    try:
        req = make_request(prompt, block_hasher=hasher)
        chain = kvbm(cbor).key_chain(req)
    finally:
        init_none_hash(sha256)
    assert isinstance(chain, VllmHashKeys) and not kvbm(cbor)._vllm_hashes.failed
    assert chain.extend(prompt) == [
        xor(h, vllm_key_mask(kvbm(cbor)._seed, b"", "sha256_cbor")) for h in req.block_hashes
    ]
    assert not set(chain.keys) & set(keys_of(plain, prompt))


def test_a_root_hash_set_since_startup_keeps_the_chain(monkeypatch):
    """Another engine in the same process re-rooting vLLM's hashes (here with
    PYTHONHASHSEED): requests hashed from that root use our chain."""
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(4 * BLOCK, 9)
    assert isinstance(k.key_chain(make_request(prompt)), VllmHashKeys)
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    try:
        init_none_hash(sha256)
        assert isinstance(k.key_chain(make_request(prompt)), KeyChain)
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        init_none_hash(sha256)
    assert isinstance(k.key_chain(make_request(prompt)), VllmHashKeys)


def test_xor_keys_and_the_chain_past_vllms_hashes():
    hashes = [bytes([i]) * 31 + bytes([255 - i]) for i in range(40)]
    mask = bytes(range(32))
    for n in range(0, 40, 3):  # both sides of the numpy threshold
        got = xor_keys(hashes, 1, 1 + n, mask)
        assert got == [xor(h, mask) for h in hashes[1 : 1 + n]]
        assert all(type(key) is bytes and len(key) == 32 for key in got)
    # vLLM hashed 3 blocks: key 3 on are our chain from key 2 (never expected
    # in practice: vLLM hashes every full block as its tokens arrive).
    toks = tokens(6 * BLOCK, 10)
    keys = VllmHashKeys(b"s" * 32, BLOCK, b"", hashes[:3], "sha256")
    keys.extend_to(toks, 2)
    got = keys.extend(toks)
    assert got[:3] == [xor(h, vllm_key_mask(b"s" * 32, b"", "sha256")) for h in hashes[:3]]
    assert got[3:] == KeyChain.continuing([], got[2], BLOCK).extend(toks[3 * BLOCK :])
