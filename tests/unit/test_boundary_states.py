"""A hybrid's Mamba state page holds the state vLLM says belongs at its
boundary, on vLLM's real Scheduler (the test plays the worker).

In align mode vLLM's block table is not positional: a Mamba2-shaped layer
(vLLM's mamba_mixer2 declares one prefill checkpoint block, alignment 1)
with ``prefix_match_unit`` below the block size exports the checkpoint of a
boundary inside a block into the column before the chunk's last, and EAGLE /
MTP relocate speculative blocks. vLLM hands connectors the exact (group,
block, boundary tokens) of each state its prefix cache keeps
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``); KVBM
stores those, at a page's end only. A vLLM without hand-offs keeps such a
model out of KVBM at startup.
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_request_block_hasher,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from helpers.scheduler_harness import (
    BLOCK,
    kvbm,
    make_request,
    make_scheduler,
    step,
    tokens,
    worker_output,
)
from test_hybrid_models import FULL, GDN, qwen3_next_layers, vllm_config_for
from vllm_kvbm import engine_info
from vllm_kvbm.engine_info import kept_out_reason
from vllm_kvbm.keys import group_key

# Gated DeltaNet state as a Mamba2 mixer declares it: one prefill checkpoint
# block, exported at any token position
MAMBA2 = dataclasses.replace(GDN, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)


def mamba2_layers(n: int = 8) -> dict:
    return {
        f"model.layers.{i}.self_attn.attn" if i % 4 == 3 else f"model.layers.{i}.mixer": FULL
        if i % 4 == 3
        else MAMBA2
        for i in range(n)
    }


@pytest.fixture(scope="module")
def dense():
    return make_scheduler()


def _config(dense, layers: dict, unit: int | None = None, retention: int | None = 0):
    """vLLM's config and the scheduler's KV cache config for these layers,
    with ``--prefix-match-unit`` ``unit`` and vLLM's default state retention
    (0: each prompt's replay boundary; None: every one)."""
    cfg = vllm_config_for(dense, layers)
    cfg.cache_config.prefix_match_unit = unit
    cfg.cache_config.prefix_cache_retention_interval = retention
    cfg.kv_transfer_config.kv_connector_extra_config["host_cache_blocks"] = 512
    worker = get_kv_cache_configs(cfg, [dict(layers)], [64 << 20])
    return cfg, generate_scheduler_kv_cache_config(worker)


def _scheduler(dense, layers: dict, unit: int | None = None, retention: int | None = 0):
    cfg, sched_config = _config(dense, layers, unit, retention)
    s = Scheduler(
        vllm_config=cfg,
        kv_cache_config=sched_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        hash_block_size=unit or BLOCK,
        log_stats=True,
    )
    assert s.connector.kept_out is None
    # the hand-offs vLLM gives the connector each step, recorded
    s.handoffs = []
    build = s.connector.build_connector_meta

    def recorded(out):
        s.handoffs.append(dict(out.kv_connector_block_state.boundary_state_offloads))
        return build(out)

    s.connector.build_connector_meta = recorded
    return s


def _request(prompt, unit):
    return make_request(
        prompt, max_tokens=2, block_hasher=get_request_block_hasher(unit or BLOCK, sha256)
    )


def _run(s, prompt, unit=None):
    """Runs ``prompt`` to its end, every store done within its step: the
    state pages stored, (page, group) -> the engine block each was stored
    from, and vLLM's hand-offs of the request."""
    req = _request(prompt, unit)
    s.add_request(req)
    k, stored = kvbm(s), {}
    keys = k.key_chain(req).extend(prompt)
    units = {
        group_key(key, g.index): (page, g.index)
        for page, key in enumerate(keys)
        for g in k.info.groups
        if g.kind == "state"
    }
    while req.request_id in s.requests:
        out = s.schedule()
        for job in out.kv_connector_metadata.stores:
            g = job.page_blocks
            for i, key in enumerate(k._store_jobs[job.job_id].keys):
                if key in units:
                    stored[units[key]] = job.block_ids[(i + 1) * g - 1]
        s.update_from_output(out, worker_output(s, out, complete=True))
    handed = [h for step_handoffs in s.handoffs for h in step_handoffs.get(req.request_id, ())]
    return stored, handed


def _load(s, prompt, unit=None):
    """vLLM's own cache cleared, the same prompt again: its load job (None:
    no hit) and its blocks per group."""
    assert s.reset_prefix_cache()
    req = _request(prompt, unit)
    s.add_request(req)
    _, meta, _ = step(s)
    groups = [list(ids) for ids in s.kv_cache_manager.get_block_ids(req.request_id)]
    return (meta.loads[0] if meta.loads else None), groups


def test_a_checkpoint_inside_a_block_is_never_stored_as_the_state_at_the_blocks_end(dense):
    """prefix_match_unit 4, 16-token blocks: a 169-token prompt computed in
    one chunk exports its checkpoint at 168 tokens into block column 9, whose
    end is 160. Stored as the state at page 9's end, a hit at 160 would run
    on from the state at 168 (wrong tokens); it is not stored, and the prompt
    again gets no hit from KVBM."""
    s = _scheduler(dense, mamba2_layers(), unit=4)
    stored, handed = _run(s, tokens(10 * BLOCK + 9, 61), unit=4)
    assert {boundary for _, _, boundary in handed} == {168}
    assert stored == {}
    load, _ = _load(s, tokens(10 * BLOCK + 9, 61), unit=4)
    assert load is None


def test_a_checkpoint_at_a_page_end_is_stored_and_loaded_at_its_hit(dense):
    """The same model, a 164-token prompt: its checkpoint is at 160 tokens,
    in column 9: stored for page 9 from the block vLLM handed off, and the
    prompt again loads it into the block vLLM allocated at the hit's end."""
    s = _scheduler(dense, mamba2_layers(), unit=4)
    prompt = tokens(10 * BLOCK + 4, 62)
    stored, handed = _run(s, prompt, unit=4)
    assert stored == {(9, g): block for g, block, boundary in handed if boundary == 160}
    assert len(stored) == 3
    load, groups = _load(s, prompt, unit=4)
    assert len(load.slots) == 10 + 3 and not load.refuse
    assert load.block_ids[:10] == groups[3][:10]
    assert load.block_ids[10:] == [groups[g][9] for g in range(3)]


@pytest.mark.parametrize("retention,pages", [(0, {39}), (None, {15, 31, 39})])
def test_a_state_is_stored_where_vllm_keeps_one(dense, retention, pages):
    """Qwen3-Next-shaped, a 648-token prompt in 256-token chunks: with vLLM's
    default retention the state is kept at the prompt's replay boundary
    (640) only, and that is what KVBM stores; kept at every chunk's end,
    each is stored."""
    s = _scheduler(dense, qwen3_next_layers(), retention=retention)
    stored, handed = _run(s, tokens(40 * BLOCK + 8, 63))
    assert {page for page, _ in stored} == pages
    assert stored == {(b // BLOCK - 1, g): block for g, block, b in handed}


@pytest.mark.parametrize(
    "layers,setting,match",
    [
        (mamba2_layers, dict(prefix_match_unit=4), "--prefix-match-unit 4"),
        (
            lambda: {
                name: dataclasses.replace(spec, num_speculative_blocks=1) if spec is GDN else spec
                for name, spec in qwen3_next_layers().items()
            },
            {},
            "speculative decoding",
        ),
    ],
)
def test_without_vllms_hand_offs_a_setting_that_moves_states_keeps_the_model_out(
    dense, monkeypatch, layers, setting, match
):
    """A vLLM whose scheduler does not hand off boundary states: the state at
    a boundary could only be read by position, which these settings break;
    the model is kept out with a message naming the setting. With the
    hand-offs (vLLM 0.32), and without the setting, it is served."""
    cfg, sched_config = _config(dense, layers(), setting.get("prefix_match_unit"))
    assert kept_out_reason(cfg, sched_config) is None
    monkeypatch.setattr(engine_info, "vllm_hands_off_states", lambda: False)
    reason = kept_out_reason(cfg, sched_config)
    assert reason is not None and match in reason and "no prefix hits" in reason
    plain, plain_config = _config(dense, qwen3_next_layers())
    assert kept_out_reason(plain, plain_config) is None
