"""The weight files vLLM's loader picked (vllm_kvbm/opened_files.py) are the
ones a model's fingerprint hashes, unchanged: a checkpoint link moved, or a
file rewritten, between vLLM's pick and KVBM's hash gives no fingerprint (the
engine's pages are its own), never the other files' keys. vLLM's real
``DefaultModelLoader`` picks the files; no engine."""

from __future__ import annotations

import json
import os

import pytest

from vllm_kvbm import fingerprints, opened_files


def _checkpoint(directory, value: float) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(
        {"model.layers.0.self_attn.k_proj.weight": torch.full((4, 4), value)},
        str(directory / "model.safetensors"),
    )


@pytest.fixture
def models(tmp_path, monkeypatch):
    """/current -> v1, and v2 beside it (other weights)."""
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "cache"))
    fingerprints.clear_memory_cache()
    opened_files.reset()
    _checkpoint(tmp_path / "v1", 1.0)
    _checkpoint(tmp_path / "v2", 2.0)
    (tmp_path / "current").symlink_to(tmp_path / "v1")
    yield tmp_path
    opened_files.reset()


def _vllm_picks(model: str) -> None:
    """What vLLM's loader does first when it loads (or reloads) ``model``."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    opened_files.install()
    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    loader._prepare_weights(model, None, None, True, None)


def test_the_files_vllm_picked_unchanged_are_the_fingerprint(models):
    current = str(models / "current")
    _vllm_picks(current)
    [picked] = [s for s in opened_files.since(0)]
    assert picked.folder_real == str(models / "v1")
    assert fingerprints.model_fingerprint(
        current, load_format="safetensors"
    ) == fingerprints.files_fingerprint(str(models / "v1"), ["config.json", "model.safetensors"])


def test_a_link_moved_after_vllm_picked_the_files_gives_no_fingerprint(models, caplog):
    current = models / "current"
    _vllm_picks(str(current))
    current.unlink()
    current.symlink_to(models / "v2")  # as `ln -sfn v2 current` during startup
    with caplog.at_level("WARNING"):
        assert fingerprints.model_fingerprint(str(current), load_format="safetensors") is None
    assert "not the ones" in caplog.text
    # Without a record of vLLM's pick (another process), the files now there
    # are hashed, as before: v2's, which that process's pages then name.
    opened_files.reset()
    assert fingerprints.model_fingerprint(
        str(current), load_format="safetensors"
    ) == fingerprints.files_fingerprint(str(models / "v2"), ["config.json", "model.safetensors"])


def test_a_file_rewritten_after_vllm_picked_it_gives_no_fingerprint(models):
    current = str(models / "current")
    _vllm_picks(current)
    path = models / "v1" / "model.safetensors"
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back; ctime moves
    assert fingerprints.model_fingerprint(current, load_format="safetensors") is None


def test_files_vllm_read_that_kvbm_would_not_hash_give_no_fingerprint(models):
    """vLLM read a file the fingerprint's file list leaves out (a loader
    override pattern): the keys would not cover it."""
    current = str(models / "current")
    extra = models / "v1" / "extra.pt"
    extra.write_bytes(b"weights")
    opened_files.record(
        current,
        current,
        [str(models / "current" / "model.safetensors"), str(models / "current" / "extra.pt")],
    )
    assert fingerprints.model_fingerprint(current, load_format="safetensors") is None


def test_the_record_is_installed_before_vllms_loader_is_imported():
    """The plugin installs it in every process before vLLM loads a model: the
    loader module is patched when it is first imported (a fresh process)."""
    import subprocess
    import sys

    code = (
        "import sys; from vllm_kvbm import opened_files; opened_files.install(); "
        f"assert {opened_files.LOADER_MODULE!r} not in sys.modules; "
        "from vllm.model_executor.model_loader.default_loader import DefaultModelLoader; "
        "assert DefaultModelLoader._prepare_weights.__kvbm_recorded__; "
        "from vllm_kvbm.on_import import PatchOnImport; "
        "assert not any(isinstance(f, PatchOnImport) for f in sys.meta_path)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
