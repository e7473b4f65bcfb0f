"""Keys name the weights vLLM loaded (weight_files.py, fingerprints.model_fingerprint):
the HF snapshot in ``--download-dir`` rather than the default HF cache, the
files a ``--load-format`` reads, a single-file (GGUF) checkpoint by its bytes,
``--trust-remote-code`` modelling code; where no file proves the weights,
an engine's pages are its own, never keyed by a config file alone. Through
engine_info, the identity code both connector sides run."""

from __future__ import annotations

import copy
import logging
import os
import shutil

import pytest

from helpers.scheduler_harness import _model_dir, make_scheduler
from vllm_kvbm import fingerprints as fp
from vllm_kvbm.engine_info import engine_info
from vllm_kvbm.weight_files import model_files

REPO = "kvbm-test/tiny-llama"


@pytest.fixture(autouse=True)
def own_caches(tmp_path, monkeypatch):
    """A digest cache and a default HF cache of this test's own."""
    import huggingface_hub.constants

    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-default"))
    fp.clear_memory_cache()
    yield
    fp.clear_memory_cache()


@pytest.fixture(scope="module")
def scheduler():
    return make_scheduler()


def seed(scheduler, **changes) -> bytes:
    """The key namespace seed of the harness engine with ``changes`` made to
    its vLLM config ("model_config.model": ..., "load_config.download_dir": ...)."""
    cfg = copy.deepcopy(scheduler.vllm_config)
    for dotted, value in changes.items():
        *part, field = dotted.split(".")
        object.__setattr__(getattr(cfg, part[0]) if part else cfg, field, value)
    page = scheduler.connector.sched.info.page_tokens
    return engine_info(cfg, scheduler.kv_cache_config, page_tokens=page).key_namespace.seed()


def hf_snapshot(cache: os.PathLike, commit: str, files: dict[str, bytes]) -> None:
    """``files`` as commit ``commit`` of REPO in an HF cache (``main`` points at it)."""
    repo = os.path.join(cache, "models--" + REPO.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    for name, data in files.items():
        with open(os.path.join(snapshot, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)


def test_download_dirs_holding_other_commits_have_other_keys(tmp_path, scheduler):
    """vLLM reads the weights from --download-dir; the default HF cache holds
    only the config it fetched there. Two replicas whose download dirs hold
    different commits of one repo must not share pages; two that hold the
    same files do."""
    config = (open(os.path.join(_model_dir(), "config.json"), "rb")).read()
    hf_snapshot(tmp_path / "hf-default", "c" * 40, {"config.json": config})
    hf_snapshot(tmp_path / "replica-a", "a" * 40, {"model.safetensors": b"weights of commit a"})
    hf_snapshot(tmp_path / "replica-b", "b" * 40, {"model.safetensors": b"weights of commit b"})
    hf_snapshot(tmp_path / "replica-c", "a" * 40, {"model.safetensors": b"weights of commit a"})

    def replica(name):
        return seed(
            scheduler,
            **{"model_config.model": REPO, "load_config.download_dir": str(tmp_path / name)},
        )

    assert replica("replica-a") != replica("replica-b")
    assert replica("replica-a") == replica("replica-c")


def test_a_single_file_checkpoint_is_keyed_by_its_bytes(tmp_path, scheduler):
    """A GGUF model is one file: copies anywhere share keys, a changed byte does not."""
    data = bytearray(os.urandom(64 << 10))
    first, copy_ = tmp_path / "a" / "model-Q4_K_M.gguf", tmp_path / "b" / "model-Q4_K_M.gguf"
    for path in (first, copy_):
        path.parent.mkdir()
        path.write_bytes(data)
    key = seed(scheduler, **{"model_config.model": str(first)})
    assert seed(scheduler, **{"model_config.model": str(copy_)}) == key
    data[1000] ^= 1
    copy_.write_bytes(data)
    assert seed(scheduler, **{"model_config.model": str(copy_)}) != key


def test_remote_modelling_code_is_in_the_keys(tmp_path, scheduler):
    model = tmp_path / "model"
    shutil.copytree(_model_dir(), model)
    (model / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    changes = {"model_config.model": str(model), "model_config.trust_remote_code": True}
    before = seed(scheduler, **changes)
    (model / "modeling_tiny.py").write_text("SCALE = 2.0\n")
    assert seed(scheduler, **changes) != before


@pytest.mark.parametrize(
    "load_format", ["dummy", "tensorizer", "runai_streamer", "a-plugin-loader"]
)
def test_a_loader_kvbm_cannot_see_into_keeps_the_engines_pages_its_own(
    scheduler, load_format, caplog
):
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.fingerprints"):
        one = seed(scheduler, **{"load_config.load_format": load_format})
    assert f"{load_format!r} loader" in caplog.text and "its own" in caplog.text
    assert seed(scheduler, **{"load_config.load_format": load_format}) == one  # this engine
    assert (
        seed(scheduler, **{"load_config.load_format": load_format, "instance_id": "another-engine"})
        != one
    )


def test_a_model_dir_with_only_a_config_is_never_keyed_by_it(tmp_path, scheduler, caplog):
    """Two engines with the same config and no weight files KVBM can name
    (a snippet once showed exactly this keyed by config.json alone) share nothing."""
    model = tmp_path / "config-only"
    model.mkdir()
    shutil.copy(os.path.join(_model_dir(), "config.json"), model)
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.fingerprints"):
        one = seed(scheduler, **{"model_config.model": str(model)})
    assert "no 'hf' weight files" in caplog.text
    assert (
        seed(scheduler, **{"model_config.model": str(model), "instance_id": "another-engine"})
        != one
    )


@pytest.mark.parametrize(
    "load_format,names,read",
    [
        ("auto", ["model.safetensors", "pytorch_model.bin"], ["model.safetensors"]),
        ("auto", ["pytorch_model.bin", "training.pt"], ["pytorch_model.bin"]),
        ("auto", ["consolidated.safetensors", "model.safetensors"], ["consolidated.safetensors"]),
        ("pt", ["model.safetensors", "model.pt"], ["model.pt"]),
        (
            "safetensors",
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "pytorch_model.bin",
            ],
            ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        ),
        ("npcache", ["pytorch_model.bin"], ["pytorch_model.bin"]),
    ],
)
def test_the_files_each_load_format_reads(tmp_path, load_format, names, read):
    for name in names + ["config.json", "tokenizer.json", "model.safetensors.index.json"]:
        (tmp_path / name).write_bytes(b"x")
    got = model_files(str(tmp_path), load_format, remote_code=False)
    assert got == sorted(read + ["config.json", "model.safetensors.index.json"])
