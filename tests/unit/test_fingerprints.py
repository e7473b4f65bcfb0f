"""Weights and LoRA identity from every byte of their files (fingerprints.py):
any byte changed changes it, copies agree, and the per-file cache is used
only while a file's stat (size, mtime, ctime, inode, device) is unchanged."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import pytest

from vllm_kvbm import fingerprints as fp

WEIGHT_BYTES = 3 << 20  # over CACHE_MIN_BYTES: its digest is cached


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache of this test's own, and no digest of another test in memory."""
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    fp.clear_memory_cache()
    yield
    fp.clear_memory_cache()


@pytest.fixture
def cache_fresh_files(monkeypatch):
    """Cache files written a moment ago (the racy-write guard would not)."""
    monkeypatch.setattr(fp, "RACY_NS", -(1 << 62))


@pytest.fixture
def hashed(monkeypatch):
    """Paths whose bytes were read by the hash, in order."""
    paths = []
    real = fp.hash_file

    def counting(path):
        paths.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fp, "hash_file", counting)
    return paths


def make_model(path, seed=0):
    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": 64}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(rng.randbytes(WEIGHT_BYTES))
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{}")  # token ids, not KV: not part of the identity
    return str(path)


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _old_samples(size):
    """Offsets the sampled fingerprint read: 16 x 4 KiB spread over the file."""
    return [(max(0, size - 4096) * i // 15, 4096) for i in range(16)]


def _between_samples(size):
    start, length = _old_samples(size)[7]
    offset = start + length + (size // 15 - length) // 2
    assert all(not (s <= offset < s + n) for s, n in _old_samples(size))
    return offset


@pytest.mark.parametrize("where", ["first", "between_samples", "last", "config"])
def test_one_byte_changed_anywhere_changes_it(tmp_path, where):
    model = make_model(tmp_path / "m")
    before = fp.files_fingerprint(model)
    weights = os.path.join(model, "model.safetensors")
    offset = {
        "first": 0,
        "between_samples": _between_samples(WEIGHT_BYTES),
        "last": WEIGHT_BYTES - 1,
    }.get(where)
    if where == "config":
        with open(os.path.join(model, "config.json"), "r+b") as f:
            f.seek(2)
            f.write(b"M")  # "model_type" -> "Model_type"
    else:
        flip(weights, offset)
    assert fp.files_fingerprint(model) != before


def test_non_identity_files_do_not_count_and_names_do(tmp_path):
    model = make_model(tmp_path / "m")
    before = fp.files_fingerprint(model)
    with open(os.path.join(model, "tokenizer.json"), "w") as f:
        f.write('{"changed": 1}')
    assert fp.files_fingerprint(model) == before
    os.rename(os.path.join(model, "model.safetensors"), os.path.join(model, "other.safetensors"))
    assert fp.files_fingerprint(model) != before


def test_same_files_elsewhere_give_the_same_value(tmp_path, monkeypatch):
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    # Another path on this host (cached under another key), and another host
    # (a cache of its own), in another directory order.
    copy = str(tmp_path / "copy")
    shutil.copytree(model, copy)
    assert fp.files_fingerprint(copy) == first
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "other-host"))
    fp.clear_memory_cache()
    reordered = str(tmp_path / "reordered")
    os.makedirs(reordered)
    for name in sorted(os.listdir(model), reverse=True):
        shutil.copy(os.path.join(model, name), os.path.join(reordered, name))
    assert fp.files_fingerprint(reordered) == first
    assert fp.files_fingerprint(make_model(tmp_path / "other", seed=1)) != first


def test_rewrite_in_place_with_same_size_and_mtime_changes_it(tmp_path, cache_fresh_files, hashed):
    model = make_model(tmp_path / "m")
    weights = os.path.join(model, "model.safetensors")
    before = fp.files_fingerprint(model)
    st = os.stat(weights)
    # The rewrite must land on a later ctime tick than the cached stat's.
    for _ in range(10_000):
        flip(weights, _between_samples(WEIGHT_BYTES))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        now = os.stat(weights)
        if now.st_ctime_ns != st.st_ctime_ns:
            break
        flip(weights, _between_samples(WEIGHT_BYTES))  # back, and try again
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert now.st_ctime_ns != st.st_ctime_ns
    fp.clear_memory_cache()  # a restart: only the on-disk cache remains
    hashed.clear()
    assert fp.files_fingerprint(model) != before
    assert "model.safetensors" in hashed


def test_cache_is_used_by_a_restart(tmp_path, cache_fresh_files, hashed):
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    assert hashed.count("model.safetensors") == 1
    fp.clear_memory_cache()
    hashed.clear()
    assert fp.files_fingerprint(model) == first
    assert "model.safetensors" not in hashed  # read from the cache entry
    assert hashed == ["config.json"]  # small files are hashed, not cached


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"{not json",
        b'{"format": "kvbm-files-v2"}',
        b'{"format": "kvbm-files-v2", "key": [], "digest": "00"}',
    ],
)
def test_corrupt_cache_entry_is_recomputed(tmp_path, cache_fresh_files, hashed, garbage):
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    entries = [p for p in os.listdir(fp.cache_dir()) if p.endswith(".json")]
    assert len(entries) == 1
    entry = os.path.join(fp.cache_dir(), entries[0])
    with open(entry, "wb") as f:
        f.write(garbage)
    fp.clear_memory_cache()
    hashed.clear()
    assert fp.files_fingerprint(model) == first
    assert "model.safetensors" in hashed
    with open(entry) as f:
        assert json.load(f)["digest"]  # rewritten whole


def test_entry_for_another_stat_is_not_used(tmp_path, cache_fresh_files):
    """An entry holds its full stat key: a digest is never served for
    another file, even if two keys' entry names collided."""
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    other = make_model(tmp_path / "other", seed=1)
    other_value = fp.files_fingerprint(other)
    entries = sorted(
        os.path.join(fp.cache_dir(), p) for p in os.listdir(fp.cache_dir()) if p.endswith(".json")
    )
    contents = [open(p, "rb").read() for p in entries]
    for path, data in zip(entries, reversed(contents)):  # swap the two entries
        with open(path, "wb") as f:
            f.write(data)
    fp.clear_memory_cache()
    assert (fp.files_fingerprint(model), fp.files_fingerprint(other)) == (first, other_value)


def test_unwritable_or_missing_cache_still_works(tmp_path, monkeypatch, cache_fresh_files, hashed):
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVBM_CACHE_DIR", str(blocker / "below"))  # cannot be created
    fp.clear_memory_cache()
    assert fp.files_fingerprint(model) == first
    monkeypatch.delenv("KVBM_CACHE_DIR")
    monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(fp.os.path, "expanduser", lambda p: p)  # no home at all
    assert fp.cache_dir() is None
    fp.clear_memory_cache()
    hashed.clear()
    assert fp.files_fingerprint(model) == first
    assert "model.safetensors" in hashed


def test_files_written_just_now_are_not_cached(tmp_path, hashed):
    """A file written within RACY_NS may change again within its ctime tick,
    so its digest is not cached: the next start reads it again."""
    model = make_model(tmp_path / "m")
    first = fp.files_fingerprint(model)
    fp.clear_memory_cache()
    hashed.clear()
    assert fp.files_fingerprint(model) == first
    assert "model.safetensors" in hashed
    assert not os.path.isdir(fp.cache_dir()) or not any(
        p.endswith(".json") for p in os.listdir(fp.cache_dir())
    )


def test_concurrent_starts_hash_once(tmp_path, cache_fresh_files, hashed):
    """The scheduler and the workers fingerprint the model at once: one of
    them reads the weights, the others wait for its cache entry."""
    model = make_model(tmp_path / "m")
    results, start = [], threading.Barrier(4)

    def one_start():
        start.wait()
        results.append(fp.files_fingerprint(model))

    threads = [threading.Thread(target=one_start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert hashed.count("model.safetensors") == 1


def make_adapter(path, seed=0):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": 8, "lora_alpha": 16, "target_modules": ["k_proj"]}, f)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(random.Random(seed).randbytes(64 << 10))
    return str(path)


def test_lora_rewritten_in_place_gets_a_new_fingerprint(tmp_path, cache_fresh_files, hashed):
    adapter = make_adapter(tmp_path / "lora")
    first = fp.adapter_fingerprint(adapter)
    hashed.clear()
    assert fp.adapter_fingerprint(adapter) == first  # unchanged files: not read again
    assert hashed == []
    weights = os.path.join(adapter, "adapter_model.safetensors")
    st = os.stat(weights)
    # New weights, same names and sizes, mtime set back, on a later ctime tick.
    for seed in range(1, 10_000):
        make_adapter(tmp_path / "lora", seed=seed)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(weights).st_ctime_ns != st.st_ctime_ns:
            break
    assert fp.adapter_fingerprint(adapter) != first
    assert "adapter_model.safetensors" in hashed
    assert fp.adapter_fingerprint(str(tmp_path / "nowhere")) == ""


def test_planner_keys_follow_the_adapter_files(tmp_path):
    from vllm.lora.request import LoRARequest

    from vllm_kvbm.scheduler.lora_adapters import lora_identity

    adapter = make_adapter(tmp_path / "lora")
    request = LoRARequest("a", 1, adapter)
    first = lora_identity(request)
    assert lora_identity(request) == first
    make_adapter(tmp_path / "lora", seed=1)
    assert lora_identity(request).fingerprint != first.fingerprint


def test_cache_keeps_to_its_size_dropping_stale_entries_first(
    tmp_path, cache_fresh_files, monkeypatch
):
    """Weights saved in place again and again (an RL loop) leave an entry per
    save: past MAX_ENTRIES the stale ones go, the live files' stay."""
    monkeypatch.setattr(fp, "MAX_ENTRIES", 4)
    cache = tmp_path / "kvbm-cache" / "fingerprints"
    live = make_model(tmp_path / "live", seed=1)
    fp.files_fingerprint(live)
    rl = make_model(tmp_path / "rl", seed=2)
    weights = os.path.join(rl, "model.safetensors")
    for step in range(6):
        flip(weights, step)  # saved again: a new entry, the old one stale
        fp.files_fingerprint(rl)
        assert len(list(cache.glob("*.json"))) <= 4
    left = {tuple(json.loads(p.read_text())["key"])[0] for p in cache.glob("*.json")}
    assert os.path.realpath(os.path.join(live, "model.safetensors")) in left
    assert os.path.realpath(weights) in left  # its current entry
    assert len(list(cache.glob("*.lock"))) == len(list(cache.glob("*.json")))
    fp.clear_memory_cache()
    hashed = []
    monkeypatch.setattr(fp, "hash_file", lambda p: hashed.append(p) or "0" * 64)
    fp.files_fingerprint(live)  # still cached after the prunes
    assert not any(p.endswith("model.safetensors") for p in hashed)


def test_cache_beyond_its_size_in_live_files_drops_the_oldest(
    tmp_path, cache_fresh_files, monkeypatch
):
    monkeypatch.setattr(fp, "MAX_ENTRIES", 4)
    cache = tmp_path / "kvbm-cache" / "fingerprints"
    for i in range(6):
        fp.files_fingerprint(make_model(tmp_path / f"m{i}", seed=i))
        assert len(list(cache.glob("*.json"))) <= 4
    left = {tuple(json.loads(p.read_text())["key"])[0] for p in cache.glob("*.json")}
    assert os.path.realpath(tmp_path / "m5" / "model.safetensors") in left  # the newest stays
