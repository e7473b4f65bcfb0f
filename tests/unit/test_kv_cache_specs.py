"""Which of vLLM's KV cache specs the connector serves: exactly the proven
types, in one KV cache group. A model of any other spec (subclasses of
FullAttentionSpec included) or of several groups starts with KVBM kept out
of its loads and stores (test_hybrid_models.py drives such models);
engine_info, which only a served model reaches, refuses every other spec with
an error naming the spec, its layers and the model."""

from __future__ import annotations

import copy

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

from helpers.scheduler_harness import BLOCK, make_scheduler
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.engine_info import engine_info, kept_out_reason

ATTN = dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
MLA = dict(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.float16)

# Every spec a KV cache group can have in vLLM 0.32, built from vLLM's classes.
REFUSED = {
    "SinkFullAttentionSpec": lambda: kvi.SinkFullAttentionSpec(**ATTN, sink_len=4),
    "RSWASpec": lambda: kvi.RSWASpec(**ATTN, rswa_window=64),
    "HiddenStateCacheSpec": lambda: kvi.HiddenStateCacheSpec(**MLA),
    "SlidingWindowSpec": lambda: kvi.SlidingWindowSpec(**ATTN, sliding_window=64),
    "SlidingWindowMLASpec": lambda: kvi.SlidingWindowMLASpec(**MLA, sliding_window=64),
    "ChunkedLocalAttentionSpec": lambda: kvi.ChunkedLocalAttentionSpec(
        **ATTN, attention_chunk_size=64
    ),
    "CircularBufferSpec": lambda: kvi.CircularBufferSpec(**ATTN),
    "CrossAttentionSpec": lambda: kvi.CrossAttentionSpec(**ATTN),
    "EncoderOnlyAttentionSpec": lambda: kvi.EncoderOnlyAttentionSpec(**ATTN),
    "MambaSpec": lambda: kvi.MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float16,)),
    "HiSparseHotSpec": lambda: kvi.HiSparseHotSpec(
        block_size=BLOCK, page_size=4096, blocks_per_request=4
    ),
    "HiSparseResidentSpec": lambda: kvi.HiSparseResidentSpec(block_size=BLOCK, page_size=4096),
    "UniformTypeKVCacheSpecs": lambda: kvi.UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs={"layer.0": kvi.FullAttentionSpec(**ATTN)}
    ),
}
ACCEPTED = {
    "FullAttentionSpec": lambda: kvi.FullAttentionSpec(**ATTN),
    "MLAAttentionSpec": lambda: kvi.MLAAttentionSpec(**MLA),
}


@pytest.fixture(scope="module")
def sched():
    return make_scheduler()


def _config(sched, *groups):
    kv = copy.deepcopy(sched.kv_cache_config)
    kv.kv_cache_groups = list(groups)
    return kv


def _group(spec, n=4, prefix="model.layers"):
    return kvi.KVCacheGroupSpec([f"{prefix}.{i}.self_attn.attn" for i in range(n)], spec)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_unproven_spec_stops_the_engine_naming_it_its_layers_and_the_model(sched, name):
    spec = REFUSED[name]()
    assert type(spec).__name__ == name
    with pytest.raises(KVBMConfigError) as err:
        engine_info(sched.vllm_config, _config(sched, _group(spec)))
    text = str(err.value)
    assert f"group 0: {name} (layers model.layers.0.self_attn.attn" in text
    assert "4 in all" in text and repr(sched.vllm_config.model_config.model) in text
    assert "without KVBMConnector" in text


@pytest.mark.parametrize("name", sorted(set(REFUSED) - {"UniformTypeKVCacheSpecs"}))
def test_a_model_of_any_unproven_spec_is_kept_out_of_kvbm_naming_the_spec(sched, name):
    """(A UniformTypeKVCacheSpecs group reaches the scheduler as its first
    layer's spec: test_hybrid_models.py checks both sides decide alike.)"""
    reason = kept_out_reason(sched.vllm_config, _config(sched, _group(REFUSED[name]())))
    assert reason is not None and f"({name}: 1 group, 4 layers)" in reason
    assert "no prefix hits come from KVBM" in reason


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_proven_specs_are_accepted(sched, name):
    spec = ACCEPTED[name]()
    kv = _config(sched, _group(spec))
    assert kept_out_reason(sched.vllm_config, kv) is None
    info = engine_info(sched.vllm_config, kv)
    assert info.block_bytes == spec.page_size_bytes * 4


def test_every_spec_class_of_vllm_is_accepted_or_refused_here():
    """A spec class a new vLLM adds is looked at before it is listed here:
    until then it is refused, by type."""
    classes = {
        c.__name__
        for c in vars(kvi).values()
        if isinstance(c, type)
        and issubclass(c, kvi.KVCacheSpec)
        and c not in (kvi.KVCacheSpec, kvi.AttentionSpec)
    }
    assert classes == set(REFUSED) | set(ACCEPTED)


def test_two_groups_name_each_group(sched):
    full, mamba = ACCEPTED["FullAttentionSpec"](), REFUSED["MambaSpec"]()
    kv = _config(sched, _group(full, 2), _group(mamba, 2, prefix="model.mixer"))
    with pytest.raises(KVBMConfigError) as err:
        engine_info(sched.vllm_config, kv)
    assert "group 0: FullAttentionSpec" in str(err.value)
    assert "group 1: MambaSpec (layers model.mixer.0.self_attn.attn, " in str(err.value)


def _vllm_groups(sched, layer_specs):
    """The KV cache groups vLLM makes of these layers with its hybrid
    allocator off (as it runs for a connector without SupportsHMA)."""
    cfg = copy.deepcopy(sched.vllm_config)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    return get_kv_cache_groups(cfg, dict(layer_specs))


def test_sliding_window_layers_among_full_ones_run_as_full_attention(sched):
    """Gemma 3's pattern with --disable-hybrid-kv-cache-manager: vLLM
    allocates full-length KV for the sliding layers (a plain
    FullAttentionSpec recording the window), so every block holds plain KV
    and KVBM serves the model."""
    layers = {
        f"model.layers.{i}.self_attn.attn": kvi.FullAttentionSpec(**ATTN)
        if i % 3 == 2
        else kvi.SlidingWindowSpec(**ATTN, sliding_window=64)
        for i in range(6)
    }
    groups = _vllm_groups(sched, layers)
    assert [type(g.kv_cache_spec) for g in groups] == [kvi.FullAttentionSpec]
    assert groups[0].kv_cache_spec.sliding_window == 64
    assert kept_out_reason(sched.vllm_config, _config(sched, *groups)) is None
    assert engine_info(sched.vllm_config, _config(sched, *groups)).num_layers == 6


def test_a_model_with_attention_sinks_is_kept_out_as_vllm_groups_it(sched):
    """Its layers merge into one group of SinkFullAttentionSpec, a subclass
    of FullAttentionSpec, which an isinstance check takes for full attention."""
    layers = {
        f"model.layers.{i}.self_attn.attn": REFUSED["SinkFullAttentionSpec"]() for i in range(4)
    }
    groups = _vllm_groups(sched, layers)
    assert "SinkFullAttentionSpec: 1 group" in kept_out_reason(
        sched.vllm_config, _config(sched, *groups)
    )
    with pytest.raises(KVBMConfigError, match="group 0: SinkFullAttentionSpec"):
        engine_info(sched.vllm_config, _config(sched, *groups))
