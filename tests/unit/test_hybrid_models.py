"""Models of several KV cache groups with vLLM's hybrid allocator (HMA) on.

KVBMConnector subclasses SupportsHMA, so vLLM keeps HMA on and a hybrid
model (Gated DeltaNet or Mamba state beside full attention, sliding-window
groups beside full ones) starts. Such a model is kept out of KVBM: no hit is
reported, nothing is stored, on either side; a dense model (one full-attention
group) is served as before. The KV cache configs come from vLLM's own
get_kv_cache_configs over per-layer specs, as the engine core makes them.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                         get_kv_cache_configs)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from helpers.scheduler_harness import (BLOCK, kvbm, make_request, make_scheduler,
                                       run_until_done, step, tokens)
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.connector import KVBMConnector
from vllm_kvbm.engine_info import engine_info, kept_out_reason, refuse_unproven_layers
from vllm_kvbm.worker.vllm_layout import layer_specs

FULL = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                             dtype=torch.float16)
# Gated DeltaNet's state (conv + recurrent) as vLLM's GDN layers declare it in
# align mode, padded to the attention page as vLLM pads it for hybrids.
GDN = kvi.MambaSpec(block_size=BLOCK, shapes=((3, 32), (2, 8, 16)),
                    dtypes=(torch.float16, torch.float16),
                    page_size_padded=FULL.page_size_bytes,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
SLIDING = kvi.SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                                dtype=torch.float16, sliding_window=64)


def qwen3_next_layers(n: int = 8) -> dict:
    """Three GDN layers, then one full-attention layer, repeated."""
    return {f"model.layers.{i}.self_attn.attn" if i % 4 == 3
            else f"model.layers.{i}.linear_attn": FULL if i % 4 == 3 else GDN
            for i in range(n)}


def gemma3_layers(n: int = 12) -> dict:
    """Five sliding-window layers, then one full-attention layer, repeated."""
    return {f"model.layers.{i}.self_attn.attn": FULL if i % 6 == 5 else SLIDING
            for i in range(n)}


@pytest.fixture(scope="module")
def dense():
    return make_scheduler()


def vllm_config_for(dense, layers: dict):
    cfg = copy.deepcopy(dense.vllm_config)
    if any(isinstance(s, kvi.MambaSpec) for s in layers.values()):
        # as vLLM's MambaModelConfig sets them with prefix caching on
        cfg.cache_config.mamba_cache_mode = "align"
        cfg.cache_config.mamba_block_size = BLOCK
    resolve_kv_cache_layout(cfg, [["LBHNC"]])  # the engine core does this first
    return cfg


def kv_cache_configs(dense, layers: dict):
    """(vllm_config, the worker's KVCacheConfig, the scheduler's), as vLLM
    makes them from these per-layer specs."""
    cfg = vllm_config_for(dense, layers)
    worker = get_kv_cache_configs(cfg, [dict(layers)], [64 << 20])
    return cfg, worker[0], generate_scheduler_kv_cache_config(worker)


def hybrid_scheduler(dense, layers: dict) -> Scheduler:
    cfg, _, sched_config = kv_cache_configs(dense, layers)
    return Scheduler(vllm_config=cfg, kv_cache_config=sched_config,
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=BLOCK, log_stats=True)


def test_the_connector_supports_hma_so_vllm_keeps_its_hybrid_allocator_on(dense):
    assert issubclass(KVBMConnector, SupportsHMA)
    transfer = dense.vllm_config.kv_transfer_config
    assert KVConnectorFactory.supports_hma_config(transfer)
    # vLLM decided, at config time, to keep HMA on for this connector
    assert dense.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize("shape,types", [
    (qwen3_next_layers, {"MambaSpec", "FullAttentionSpec"}),
    (gemma3_layers, {"SlidingWindowSpec", "FullAttentionSpec"}),
])
def test_vllm_makes_several_groups_of_these_models(dense, shape, types):
    _, worker, sched_config = kv_cache_configs(dense, shape())
    for config in (worker, sched_config):
        assert len(config.kv_cache_groups) > 1
        assert {type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups} == types


@pytest.mark.parametrize("shape,named", [
    (qwen3_next_layers, ["MambaSpec: 3 groups, 6 layers", "FullAttentionSpec: 1 group, 2 layers"]),
    (gemma3_layers, ["SlidingWindowSpec:", "FullAttentionSpec:",
                     "--disable-hybrid-kv-cache-manager"]),
])
def test_a_hybrid_model_starts_is_never_served_by_kvbm_and_vllms_cache_still_hits(
        dense, caplog, shape, named):
    with caplog.at_level(logging.INFO, logger="vllm_kvbm.connector"):
        s = hybrid_scheduler(dense, shape())
    lines = [r.getMessage() for r in caplog.records if "does not serve yet" in r.getMessage()]
    assert len(lines) == 1 and "no prefix hits come from KVBM" in lines[0]
    assert all(part in lines[0] for part in named)
    connector = s.connector
    assert connector.kept_out is not None and connector.sched is None

    prompt = tokens(3 * BLOCK + 8, 1)
    first = make_request(prompt, max_tokens=3)
    s.add_request(first)
    assert connector.get_num_new_matched_tokens(first, 0) == (0, False)
    _, meta, _ = step(s)
    assert not meta.loads and not meta.stores and not meta.spills
    run_until_done(s, first.request_id)
    # vLLM finished it through request_finished_all_groups: no delayed free
    assert first.request_id not in s.requests

    again = make_request(prompt, max_tokens=3)
    s.add_request(again)
    assert connector.get_num_new_matched_tokens(again, 0) == (0, False)
    out, meta, _ = step(s)
    assert not meta.loads and not meta.stores
    # the engine's own prefix cache still serves the prefix
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    run_until_done(s, again.request_id)
    assert connector.get_kv_connector_stats() is None
    assert not connector.has_pending_push_work() and list(connector.take_events()) == []
    assert s.reset_prefix_cache()


def test_request_finished_all_groups_returns_what_vllm_expects(dense):
    s = hybrid_scheduler(dense, qwen3_next_layers())
    req = make_request(tokens(2 * BLOCK, 3))
    groups = tuple([1, 2] for _ in s.kv_cache_config.kv_cache_groups)
    assert s.connector.request_finished_all_groups(req, groups) == (False, None)


def test_a_dense_model_is_served_and_its_stores_delay_the_free_through_all_groups():
    """One full-attention group: vLLM now ends requests through
    request_finished_all_groups; a store in flight still keeps the blocks."""
    s = make_scheduler()
    assert s.connector.kept_out is None and len(s.kv_cache_config.kv_cache_groups) == 1
    req = make_request(tokens(2 * BLOCK, 4), max_tokens=1)
    s.add_request(req)
    _, meta, _ = step(s)
    assert [job.req_id for job in meta.stores] == [req.request_id]
    block_ids = s.kv_cache_manager.get_block_ids(req.request_id)
    assert s.connector.request_finished_all_groups(req, block_ids) == (True, None)
    assert kvbm(s).has_pending_work()


@pytest.mark.parametrize("shape", [qwen3_next_layers, gemma3_layers])
def test_the_worker_side_of_a_hybrid_model_copies_nothing(dense, shape):
    cfg, worker_config, _ = kv_cache_configs(dense, shape())
    connector = KVBMConnector(cfg, KVConnectorRole.WORKER, worker_config)
    assert connector.worker is None and connector.kept_out is not None
    caches = {name: torch.zeros(4, 64) for name in layer_specs(worker_config)}
    connector.register_kv_caches(caches)
    connector.bind_connector_metadata(connector.build_connector_meta(None))
    connector.start_load_kv(None)
    connector.wait_for_save()
    assert connector.get_finished({"r1"}) == (set(), set())
    assert connector.get_block_ids_with_load_errors() == set()
    assert connector.build_connector_worker_meta() is None
    connector.unregister_kv_caches()  # nothing registered: nothing to refuse
    connector.shutdown()


def test_both_sides_decide_alike_for_a_group_of_one_type_and_several_shapes(dense):
    """Full-attention layers of two head sizes: one UniformTypeKVCacheSpecs
    group for the worker, its first layer's FullAttentionSpec for the
    scheduler. Both take it as served; the worker then checks each layer and
    refuses the group at startup rather than copy it as one spec."""
    wide = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                                 dtype=torch.float16)
    layers = {f"model.layers.{i}.self_attn.attn": FULL if i % 2 else wide for i in range(4)}
    cfg, worker, sched_config = kv_cache_configs(dense, layers)
    assert type(worker.kv_cache_groups[0].kv_cache_spec) is kvi.UniformTypeKVCacheSpecs
    assert type(sched_config.kv_cache_groups[0].kv_cache_spec) is kvi.FullAttentionSpec
    assert kept_out_reason(cfg, worker) is None and kept_out_reason(cfg, sched_config) is None
    with pytest.raises(KVBMConfigError, match="UniformTypeKVCacheSpecs"):
        engine_info(cfg, worker)


def test_the_worker_refuses_a_layer_whose_spec_is_not_plain_kv(dense):
    sink = kvi.SinkFullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                                     dtype=torch.float16, sink_len=4)
    group = kvi.KVCacheGroupSpec(["a", "b"], kvi.UniformTypeKVCacheSpecs(
        block_size=BLOCK, kv_cache_specs={"a": FULL, "b": sink}))
    config = kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    specs = layer_specs(config)
    refuse_unproven_layers(specs, ["a"])
    with pytest.raises(KVBMConfigError, match="b: SinkFullAttentionSpec"):
        refuse_unproven_layers(specs, ["a", "b"])
