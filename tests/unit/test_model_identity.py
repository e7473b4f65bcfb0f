"""What block keys know about the model: its weights, its KV cache format and
the parallelism the page format supports (startup refusals)."""

from __future__ import annotations

import copy
import shutil

import pytest

from helpers.scheduler_harness import kvbm, make_scheduler
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.engine_info import engine_info
from vllm_kvbm.fingerprints import files_fingerprint


def test_new_weights_at_the_same_path_change_the_fingerprint(tmp_path):
    from vllm_kvbm.tools.local_model import build

    path = tmp_path / "model"
    build(path, layers=2, hidden=64, heads=2, kv_heads=2, vocab_size=300, seed=0)
    first = files_fingerprint(str(path))
    copy_dir = tmp_path / "copy"
    shutil.copytree(path, copy_dir)
    # Same files elsewhere (another host, another mount): same keys, so engines share.
    assert files_fingerprint(str(copy_dir)) == first
    build(path, layers=2, hidden=64, heads=2, kv_heads=2, vocab_size=300, seed=1, force=True)
    assert files_fingerprint(str(path)) != first  # a fine-tune / RL update in place


def _seed_with(scheduler, change) -> bytes:
    cfg = copy.deepcopy(scheduler.vllm_config)
    change(cfg)
    page = kvbm(scheduler).info.page_tokens  # the harness's, not the default
    return engine_info(cfg, scheduler.kv_cache_config, page_tokens=page).key_namespace.seed()


def test_kv_cache_dtype_and_quantization_are_in_the_keys():
    s = make_scheduler()
    base = kvbm(s).info.key_namespace.seed()
    assert _seed_with(s, lambda c: None) == base

    def cache_dtype(name):
        def change(c):
            c.cache_config.cache_dtype = name

        return change

    e4m3, e5m2 = _seed_with(s, cache_dtype("fp8_e4m3")), _seed_with(s, cache_dtype("fp8_e5m2"))
    assert len({base, e4m3, e5m2}) == 3

    def quant(c):
        c.model_config.quantization = "fp8"

    assert _seed_with(s, quant) != base


@pytest.mark.parametrize(
    "field,flag",
    [
        ("pipeline_parallel_size", "--pipeline-parallel-size 1"),
        ("decode_context_parallel_size", "--decode-context-parallel-size 1"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size 1"),
    ],
)
def test_pipeline_and_context_parallelism_are_refused_at_startup(field, flag):
    s = make_scheduler()
    cfg = copy.deepcopy(s.vllm_config)
    object.__setattr__(cfg.parallel_config, field, 2)
    with pytest.raises(KVBMConfigError) as err:
        engine_info(cfg, s.kv_cache_config)
    assert field in str(err.value) and flag in str(err.value)


def _seed_with_spec(scheduler, page_tokens: int, **spec_changes) -> bytes:
    """The namespace seed of the harness engine with its KV cache spec changed."""
    import dataclasses

    kv = copy.deepcopy(scheduler.kv_cache_config)
    group = kv.kv_cache_groups[0]
    group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec, **spec_changes)
    return engine_info(scheduler.vllm_config, kv, page_tokens=page_tokens).key_namespace.seed()


def test_the_same_page_in_other_vllm_blocks_has_other_keys():
    """256-token pages of 32-token and of 64-token blocks hold the same bytes
    in another order: a page's keys name its vLLM block size, not only its tokens."""
    s = make_scheduler()
    assert _seed_with_spec(s, 256, block_size=32) != _seed_with_spec(s, 256, block_size=64)
    assert _seed_with_spec(s, 256, block_size=32) == _seed_with_spec(s, 256, block_size=32)


def test_every_field_of_vllms_kv_cache_spec_is_in_the_keys():
    import torch

    s = make_scheduler()
    base = _seed_with_spec(s, 16)
    for change in (
        dict(head_size=16),
        dict(num_kv_heads=1),
        dict(dtype=torch.bfloat16),
        dict(sliding_window=64),
        dict(page_size_padded=4096),
        dict(head_size_v=16),
    ):
        assert _seed_with_spec(s, 16, **change) != base, change


def test_the_same_model_files_at_another_path_share_keys(tmp_path):
    """Replicas keep their copy of a model wherever they like: the weights'
    hash names the model, not its path."""
    from helpers.scheduler_harness import _model_dir

    copy_dir = tmp_path / "elsewhere"
    shutil.copytree(_model_dir(), copy_dir)
    here = kvbm(make_scheduler()).info.key_namespace
    there = kvbm(make_scheduler(model=str(copy_dir))).info.key_namespace
    assert here.seed() == there.seed()
    (copy_dir / "config.json").write_text(
        (copy_dir / "config.json")
        .read_text()
        .replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    )
    assert kvbm(make_scheduler(model=str(copy_dir))).info.key_namespace.seed() != here.seed()


def test_vllm_and_torch_releases_are_in_the_keys(monkeypatch):
    import vllm_kvbm.identity as identity

    s = make_scheduler()
    base = _seed_with(s, lambda c: None)
    monkeypatch.setattr(identity, "software_versions", lambda: {"vllm": "9.9.9", "torch": "0"})
    assert _seed_with(s, lambda c: None) != base
