"""Weights changed in place on real engines: the keys follow every byte of the
weights (vllm_kvbm/fingerprints.py), so pages computed with the old weights
are never onboarded by an engine running the new ones.

One tensor of the safetensors file (one layer's k_proj) is scaled and written
back into the same file: same size, same inode, mtime set back, as a merged
adapter or a partial fine-tune saved in place would leave it. The tensor is
one that the earlier 16 x 4 KiB samples per file did not read.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

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
from test_engine_e2e import expected_hit_tokens, generate
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

HOST_BLOCKS = 16
PROMPT = random_prompt(6 * BLOCK_SIZE + 10, seed=7301)


def _tensor_ranges(path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        name: (8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def _unsampled_k_proj(path) -> str:
    """A k_proj tensor none of the old fingerprint's 16 x 4 KiB samples touched."""
    size = os.path.getsize(path)
    samples = [(max(0, size - 4096) * i // 15, 4096) for i in range(16)]
    for name, (start, end) in sorted(_tensor_ranges(path).items()):
        if name.endswith("k_proj.weight") and all(s + n <= start or s >= end for s, n in samples):
            return name
    raise AssertionError(f"every k_proj of {path} overlaps a sample")


def rewrite_one_tensor_in_place(path) -> str:
    from safetensors.torch import load_file, save

    name = _unsampled_k_proj(path)
    st = os.stat(path)
    tensors = load_file(path)
    tensors[name] = tensors[name] * 4
    data = save(tensors, metadata={"format": "pt"})
    assert len(data) == st.st_size
    with open(path, "r+b") as f:  # the same file, not a new one renamed over it
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_size, now.st_ino, now.st_mtime_ns) == (st.st_size, st.st_ino, st.st_mtime_ns)
    return name


def test_weights_rewritten_in_place_onboard_nothing_old(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    disk = tmp_path / "disk"
    disk.mkdir()
    config = kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk),
        disk_cache_size="1GiB",
        **EVERY_PAGE_LOADED,
    )

    old = make_llm(config, model=str(model))
    try:
        old_out, _ = generate(old, [PROMPT])
        clear_engine_and_host(old, HOST_BLOCKS)
        # The control: the old weights' pages are on disk and found there.
        disk_hits = kvbm_counter("matched_tokens_disk")
        again, cached = generate(old, [PROMPT])
        assert again == old_out and cached[0] == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("matched_tokens_disk") - disk_hits == cached[0]
    finally:
        shutdown(old)
    assert any(p.is_file() for p in disk.rglob("*"))

    rewrite_one_tensor_in_place(model / "model.safetensors")

    new = make_llm(config, model=str(model))
    try:
        matched, onboarded = kvbm_counter("matched_tokens"), kvbm_counter("onboard_blocks_d2d")
        got, cached = generate(new, [PROMPT])
        assert cached == [0]
        assert kvbm_counter("matched_tokens") == matched
        assert kvbm_counter("onboard_blocks_d2d") == onboarded
    finally:
        shutdown(new)
    # Nothing was loaded, so `got` is the new weights' own recompute; the
    # scaled tensor changes the answer: old pages served would have shown.
    assert got != old_out
