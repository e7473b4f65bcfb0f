"""Models of several KV cache groups with vLLM's hybrid allocator (HMA) on.

KVBMConnector subclasses SupportsHMA, so vLLM keeps HMA on and a hybrid
model (Gated DeltaNet or Mamba state beside full attention, sliding-window
groups beside full ones) starts, and KVBM pages each group as its hits read
it (scheduler/group_pages.py): full attention for the whole prefix, a
sliding window only before the boundaries a hit may end at, the Mamba/GDN
state where vLLM computed it. The KV cache configs come from vLLM's own
get_kv_cache_configs over per-layer specs, as the engine core makes them; the
scheduler is vLLM's own, its worker a fake that finishes every copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from helpers.scheduler_harness import (
    BLOCK,
    keys_of,
    kvbm,
    make_request,
    make_scheduler,
    run_to_end,
    step,
    tokens,
)
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.connector import KVBMConnector
from vllm_kvbm.engine_info import engine_info, kept_out_reason, refuse_unproven_layers
from vllm_kvbm.keys import group_key
from vllm_kvbm.worker.vllm_layout import layer_specs

FULL = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
# Gated DeltaNet's state (conv + recurrent) as vLLM's GDN layers declare it in
# align mode, padded to the attention page as vLLM pads it for hybrids.
GDN = kvi.MambaSpec(
    block_size=BLOCK,
    shapes=((3, 32), (2, 8, 16)),
    dtypes=(torch.float16, torch.float16),
    page_size_padded=FULL.page_size_bytes,
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    mamba_cache_mode="align",
)
SLIDING = kvi.SlidingWindowSpec(
    block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64
)


CHUNKED = kvi.ChunkedLocalAttentionSpec(
    block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, attention_chunk_size=64
)


def llama4_layers(n: int = 8) -> dict:
    """Three chunked-local attention layers, then one full-attention layer, repeated."""
    return {f"model.layers.{i}.self_attn.attn": FULL if i % 4 == 3 else CHUNKED for i in range(n)}


def qwen3_next_layers(n: int = 8) -> dict:
    """Three GDN layers, then one full-attention layer, repeated."""
    return {
        f"model.layers.{i}.self_attn.attn" if i % 4 == 3 else f"model.layers.{i}.linear_attn": FULL
        if i % 4 == 3
        else GDN
        for i in range(n)
    }


def gemma3_layers(n: int = 12) -> dict:
    """Five sliding-window layers, then one full-attention layer, repeated."""
    return {f"model.layers.{i}.self_attn.attn": FULL if i % 6 == 5 else SLIDING for i in range(n)}


@pytest.fixture(scope="module")
def dense():
    return make_scheduler()


def vllm_config_for(dense, layers: dict):
    cfg = copy.deepcopy(dense.vllm_config)
    if any(isinstance(s, kvi.MambaSpec) for s in layers.values()):
        # as vLLM's MambaModelConfig sets them with prefix caching on
        cfg.cache_config.mamba_cache_mode = "align"
        cfg.cache_config.mamba_block_size = BLOCK
        # vLLM keeps (and hands off) the state at every chunk's end, not only
        # at each prompt's replay boundary (its default, 0: test_boundary_states.py)
        cfg.cache_config.prefix_cache_retention_interval = None
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
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=sched_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )


def test_the_connector_supports_hma_so_vllm_keeps_its_hybrid_allocator_on(dense):
    assert issubclass(KVBMConnector, SupportsHMA)
    transfer = dense.vllm_config.kv_transfer_config
    assert KVConnectorFactory.supports_hma_config(transfer)
    # vLLM decided, at config time, to keep HMA on for this connector
    assert dense.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize(
    "shape,types",
    [
        (qwen3_next_layers, {"MambaSpec", "FullAttentionSpec"}),
        (gemma3_layers, {"SlidingWindowSpec", "FullAttentionSpec"}),
    ],
)
def test_vllm_makes_several_groups_of_these_models(dense, shape, types):
    _, worker, sched_config = kv_cache_configs(dense, shape())
    for config in (worker, sched_config):
        assert len(config.kv_cache_groups) > 1
        assert {type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups} == types


def _stored(metas) -> list[tuple[list[int], list[int]]]:
    return [(job.block_ids, job.slots) for meta in metas for job in meta.stores]


def _served(dense, shape, prompt_blocks: int, extra: int = 8):
    """A hybrid scheduler with a host tier large enough for the test's pages,
    after one request of ``prompt_blocks`` blocks (and ``extra`` tokens) ran to its
    end (every store done within its step): (scheduler, its prompt, the
    store jobs' (block ids, slots))."""
    cfg, _, sched_config = kv_cache_configs(dense, shape())
    cfg.kv_transfer_config.kv_connector_extra_config["host_cache_blocks"] = 512
    s = Scheduler(
        vllm_config=cfg,
        kv_cache_config=sched_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )
    assert s.connector.kept_out is None and kvbm(s).groups is not None
    prompt = tokens(prompt_blocks * BLOCK + extra, 1)
    metas = run_to_end(s, make_request(prompt, max_tokens=2))
    assert all(job.before_next_step for meta in metas for job in meta.stores)
    return s, prompt, _stored(metas)


def _load(s, prompt):
    """vLLM's own cache cleared, the same prompt: its load job and its blocks per group."""
    assert s.reset_prefix_cache()
    req = make_request(prompt, max_tokens=2)
    s.add_request(req)
    _, meta, _ = step(s)
    (load,) = meta.loads
    return load, [list(ids) for ids in s.kv_cache_manager.get_block_ids(req.request_id)]


def test_a_gdn_hybrid_stores_the_state_where_vllm_computed_it_and_loads_it_at_the_hit(dense):
    """Three Gated DeltaNet groups (align mode) and one full-attention group.
    Each 256-token chunk's end is a block boundary where vLLM computed the
    state: every full-attention page is stored, and each GDN group's state
    block at those boundaries only. A hit then loads the prefix's pages and
    each GDN group's state at its end, into the blocks vLLM allocated."""
    s, prompt, stores = _served(dense, qwen3_next_layers, 40)
    info = kvbm(s).info
    assert [g.kind for g in info.groups] == ["state", "state", "state", "full"]
    assert info.primary == 3
    # 16 blocks a chunk (256 tokens): states at pages 15, 31 and 39 (the
    # prompt's last full block, computed as its own chunk in align mode)
    assert [len(slots) for _, slots in stores] == [16 + 3, 16 + 3, 8 + 3]

    load, groups = _load(s, prompt)
    assert len(load.slots) == 40 + 3 and not load.refuse
    assert load.block_ids[:40] == groups[3][:40]
    assert load.block_ids[40:] == [groups[g][39] for g in range(3)]
    assert all(groups[g][:39] == [0] * 39 for g in range(3))  # no other state read


def test_sliding_window_groups_store_only_the_windows_a_hit_reads(dense):
    """Five sliding-window groups (64-token window: 4 pages of 16 tokens
    before a boundary) and a full-attention one. Of a 40-page prompt the
    window groups store the window before the prompt's end and before every
    16 pages (4 windows): 12 pages each, not 40; a hit loads the prefix's
    full-attention pages and the last window's."""
    s, prompt, stores = _served(dense, gemma3_layers, 40)
    info = kvbm(s).info
    assert [g.kind for g in info.groups] == ["window"] * 5 + ["full"]
    assert {g.window for g in info.groups[:5]} == {63}
    stored_pages = sum(len(slots) for _, slots in stores)
    assert stored_pages == 40 + 5 * 12  # against 40 * 6 stored whole

    load, groups = _load(s, prompt)
    assert len(load.slots) == 40 + 5 * 4 and not load.refuse
    assert load.block_ids[:40] == groups[5][:40]
    assert sorted(load.block_ids[40:]) == sorted(b for g in range(5) for b in groups[g][36:40])


def test_chunked_local_groups_store_and_load_only_the_last_chunk_of_the_prompt(dense):
    """Three chunked-local groups (64-token chunks: 4 pages) and a full one.
    A 42-page prompt: each chunked group stores the pages of the chunk its
    hit ends in (40, 41), none before (a hit at a chunk's start reads none)."""
    s, prompt, stores = _served(dense, llama4_layers, 42)
    info = kvbm(s).info
    assert [g.kind for g in info.groups] == ["chunk"] * 3 + ["full"]
    assert sum(len(slots) for _, slots in stores) == 42 + 3 * 2
    load, groups = _load(s, prompt)
    assert len(load.slots) == 42 + 3 * 2 and not load.refuse
    assert sorted(load.block_ids[42:]) == sorted(b for g in range(3) for b in groups[g][40:42])
    assert all(b == 0 for g in range(3) for b in groups[g][:40])  # vLLM keeps only the chunk


def test_a_page_aligned_prompt_comes_back_with_the_window_before_its_last_page(dense):
    """A 40-page prompt, no token after: the same prompt again hits 39 pages
    (vLLM computes its last token itself), so the window before page 39 is
    kept as well as the one before page 40 (the next turn's hit)."""
    s, prompt, stores = _served(dense, gemma3_layers, 40, extra=0)
    # windows before 39 and 40 (pages 35-39), before 16 and 32 (12-15, 28-31)
    assert sum(len(slots) for _, slots in stores) == 40 + 5 * 13
    load, groups = _load(s, prompt)
    assert len(load.slots) == 39 + 5 * 4 and not load.refuse
    assert sorted(load.block_ids[39:]) == sorted(b for g in range(5) for b in groups[g][35:39])


@pytest.mark.parametrize("shape", [qwen3_next_layers, gemma3_layers])
def test_a_group_page_is_never_another_groups_or_the_prefix_page(dense, shape):
    s, prompt, _ = _served(dense, shape, 4)
    keys = keys_of(s, prompt)
    named = {group_key(k, g.index) for k in keys for g in kvbm(s).info.groups}
    assert len(named) == len(keys) * len(kvbm(s).info.groups)
    assert not named & set(keys)


def test_a_hit_stops_where_a_group_lacks_what_it_reads(dense):
    """The state at the prompt's end evicted from the host tier: the hit
    falls back to the last boundary every group can serve (page 32)."""
    s, prompt, _ = _served(dense, qwen3_next_layers, 40)
    keys = keys_of(s, prompt)
    for g in range(3):
        assert kvbm(s).host.drop(group_key(keys[39], g))
    load, groups = _load(s, prompt)
    assert len(load.slots) == 32 + 3
    assert load.block_ids[32:] == [groups[g][31] for g in range(3)]


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


def test_both_sides_decide_alike_for_a_group_of_one_type_and_several_shapes(dense):
    """Full-attention layers of two head sizes: one UniformTypeKVCacheSpecs
    group for the worker, its first layer's FullAttentionSpec for the
    scheduler. Both take it as served; the worker then checks each layer and
    refuses the group at startup rather than copy it as one spec."""
    wide = kvi.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16
    )
    layers = {f"model.layers.{i}.self_attn.attn": FULL if i % 2 else wide for i in range(4)}
    cfg, worker, sched_config = kv_cache_configs(dense, layers)
    assert type(worker.kv_cache_groups[0].kv_cache_spec) is kvi.UniformTypeKVCacheSpecs
    assert type(sched_config.kv_cache_groups[0].kv_cache_spec) is kvi.FullAttentionSpec
    assert kept_out_reason(cfg, worker) is None and kept_out_reason(cfg, sched_config) is None
    with pytest.raises(KVBMConfigError, match="UniformTypeKVCacheSpecs"):
        engine_info(cfg, worker)


def test_the_worker_refuses_a_layer_whose_spec_is_not_plain_kv(dense):
    sink = kvi.SinkFullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, sink_len=4
    )
    group = kvi.KVCacheGroupSpec(
        ["a", "b"],
        kvi.UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs={"a": FULL, "b": sink}),
    )
    config = kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    specs = layer_specs(config)
    refuse_unproven_layers(specs, ["a"])
    with pytest.raises(KVBMConfigError, match="b: SinkFullAttentionSpec"):
        refuse_unproven_layers(specs, ["a", "b"])


def test_a_preempted_hybrid_request_is_flushed_then_comes_back_with_its_state(dense):
    """32 blocks for two 132-token GDN-hybrid prompts decoding: vLLM preempts
    one, freeing every group's blocks while their stores are in flight (the
    step's metadata flushes them; the blocks they read stay held until they
    are reported); it comes back through the host tier: its attention pages
    and each GDN group's state at the prompt's end."""
    small = make_scheduler(max_model_len=256)
    cfg = vllm_config_for(small, qwen3_next_layers())
    cfg.kv_transfer_config.kv_connector_extra_config["host_cache_blocks"] = 256
    worker = get_kv_cache_configs(cfg, [qwen3_next_layers()], [64 << 10])
    s = Scheduler(
        vllm_config=cfg,
        kv_cache_config=generate_scheduler_kv_cache_config(worker),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )
    assert s.kv_cache_config.num_blocks == 32
    reqs = [make_request(tokens(8 * BLOCK + 4, base), max_tokens=100) for base in (21, 22)]
    for req in reqs:
        s.add_request(req)
    _, meta, _ = step(s)  # both prompts computed: their stores not reported yet
    jobs = {job.req_id: job for job in meta.stores}
    assert {r: len(j.slots) for r, j in jobs.items()} == {r.request_id: 8 + 3 for r in reqs}
    for _ in range(100):  # decoding, the prompts' stores still in flight
        out, meta, _ = step(s)
        if out.preempted_req_ids:
            break
    (victim,) = [r for r in reqs if r.request_id in out.preempted_req_ids]
    assert victim.status == RequestStatus.PREEMPTED
    # its blocks are freed now: the workers finish reading them first
    assert meta.flush_req_ids == [victim.request_id]
    step(s, stores_done=[job.job_id for job in jobs.values()])

    (other,) = [r for r in reqs if r is not victim]
    s.finish_requests(other.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache()
    _, meta, _ = step(s)
    assert victim.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = meta.loads
    groups = [list(ids) for ids in s.kv_cache_manager.get_block_ids(victim.request_id)]
    assert len(load.slots) == 8 + 3 and not load.refuse
    assert load.block_ids[:8] == groups[3][:8]
    assert load.block_ids[8:] == [groups[g][7] for g in range(3)]


@pytest.mark.parametrize("shape", [qwen3_next_layers, gemma3_layers])
def test_a_failed_hybrid_load_is_recomputed_whole_and_the_engine_goes_on(dense, shape):
    """A hybrid hit whose load fails (a corrupt page, a tier gone, a refused
    load...). vLLM stops the engine on block ids from a model of several KV
    cache groups; the worker names the request in failed_recving instead, as
    vLLM asks: vLLM frees its blocks and schedules it again, the connector
    then answers "recompute" (no second load of the same pages), drops the
    pages that may be bad, and stores them again as the request recomputes them."""
    s, prompt, _ = _served(dense, shape, 12)
    assert s.reset_prefix_cache()
    req = make_request(prompt, max_tokens=2)
    s.add_request(req)
    _, meta, _ = step(s)
    (load,) = meta.loads
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(
        s,
        loads_failed=[req.request_id],
        finished_recving=[req.request_id],
        failed_recving=[req.request_id],
    )
    assert req.num_computed_tokens == 0  # vLLM recomputes it whole
    assert kvbm(s).stats.total["load_error_blocks"] == load.num_blocks
    host = kvbm(s).host
    keys = keys_of(s, prompt)
    assert not any(k in host for k in keys)  # its bytes may be bad: dropped
    out, meta, _ = step(s, complete=True)
    assert not meta.loads
    (new,) = out.scheduled_new_reqs  # admitted again, from its first token
    assert new.req_id == req.request_id and new.num_computed_tokens == 0
    for _ in range(50):
        if req.is_finished():
            break
        step(s, complete=True)
    assert req.is_finished()
    assert all(k in host for k in keys)  # recomputed, stored again
