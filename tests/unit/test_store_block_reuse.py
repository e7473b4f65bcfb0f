"""No store reads an engine block that vLLM has freed, zeroed, copied into or
handed to another request, on vLLM's real Scheduler (the test plays the
worker, as in scheduler_harness).

A store is planned at schedule time and copied after the step's forward, so
it is still reading its blocks when the next step is scheduled and starts
on the worker. Under vLLM 0.32's Model Runner V2 (the default on CUDA) that
next step zeroes the blocks it allocated (models with Mamba layers) and runs
its copy-on-write copies in ``update_requests``, before the connector's
``handle_preemptions`` is called (``pre_forward``); Model Runner V1 calls
``handle_preemptions`` first. V2 does not start on vLLM's CPU build ("Model
Runner V2 requires Triton"), so these tests check what makes the order
irrelevant: a block a store has not been reported done with is never in a
later step's ``new_block_ids_to_zero``, never a copy's destination and never
a block newly given to a request.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
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
from test_hybrid_models import gemma3_layers, qwen3_next_layers, vllm_config_for


def test_a_backlog_of_a_request_preempted_this_step_is_dropped_not_stored(tmp_path):
    """7 usable blocks, a 4-page host tier and a disk tier: two 48-token
    prompts take 3 blocks each; the first gets 3 host slots, the second 1 (its
    other 2 pages wait as its backlog). The first's store fails, so 3 slots
    are free when the first decode step needs 2 more blocks and vLLM preempts
    the second, freeing its blocks: its backlog must be dropped, not stored
    from blocks it no longer has."""
    s = make_scheduler(
        num_blocks=8, host_blocks=4, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB"
    )
    k = kvbm(s)
    r1 = make_request(tokens(48, 14), max_tokens=20)
    r2 = make_request(tokens(48, 15), max_tokens=20)
    s.add_request(r1)
    s.add_request(r2)
    out = s.schedule()
    while not out.num_scheduled_tokens:  # until the disk tier's lookup answered
        s.update_from_output(out, worker_output(s, out))
        time.sleep(0.005)
        out = s.schedule()
    jobs = {j.req_id: j for j in out.kv_connector_metadata.stores}
    assert [len(jobs[r.request_id].slots) for r in (r1, r2)] == [3, 1]
    assert r2.request_id in k._backlogged
    s.update_from_output(
        out,
        worker_output(
            s,
            out,
            stores_failed=[jobs[r1.request_id].job_id],
            stores_done=[jobs[r2.request_id].job_id],
        ),
    )

    out, meta, _ = step(s)
    assert out.preempted_req_ids == {r2.request_id}
    assert r2.status == RequestStatus.PREEMPTED
    assert not [j for j in meta.stores if j.req_id == r2.request_id]
    assert r2.request_id not in k._backlogged
    assert k.stats.total["store_skipped_blocks"] == 2


def _fresh_blocks(s) -> list[int]:
    """The ids of the blocks vLLM's block pool hands out from its free queue
    (to any request, group, copy-on-write copy), appended as it does."""
    pool = s.kv_cache_manager.block_pool
    fresh: list[int] = []
    get_new_blocks = pool.get_new_blocks

    def recorded(num_blocks):
        blocks = get_new_blocks(num_blocks)
        fresh.extend(b.block_id for b in blocks)
        return blocks

    pool.get_new_blocks = recorded
    return fresh


def _hybrid_scheduler(dense, layers, kv_bytes: int, max_batched: int = 256) -> Scheduler:
    cfg = vllm_config_for(dense, layers)
    cfg.kv_transfer_config.kv_connector_extra_config["host_cache_blocks"] = 256
    cfg.scheduler_config.max_num_batched_tokens = max_batched
    worker = get_kv_cache_configs(cfg, [dict(layers)], [kv_bytes])
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=generate_scheduler_kv_cache_config(worker),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )


@pytest.mark.parametrize(
    "shape,max_len,kv_bytes,prompts",
    [
        # 24 blocks for two GDN-hybrid prompts decoding: vLLM preempts one and
        # hands its blocks (zeroed: the model has Mamba layers) to the other
        (qwen3_next_layers, 256, 48 << 10, ((8 * BLOCK + 4, 21), (8 * BLOCK + 4, 22))),
        # a long GDN prompt: vLLM frees each chunk's state block as the next
        # chunk's goes on, and hands it out again
        (qwen3_next_layers, 720, 128 << 10, ((40 * BLOCK + 8, 23), (6 * BLOCK, 24))),
        # Gemma 3-shaped: sliding-window blocks freed as the window moves on
        (gemma3_layers, 720, 384 << 10, ((40 * BLOCK + 8, 25), (6 * BLOCK, 26))),
    ],
)
def test_no_block_a_store_still_reads_is_zeroed_copied_into_or_handed_out(
    shape, max_len, kv_bytes, prompts
):
    """A worker reports each step's stores done with the next step's output
    (its copies run after the step's forward); until then, whatever the model
    runner's order of zeroing, copying and ``handle_preemptions``, none of
    their blocks may be zeroed, copied into or given to a request."""
    s = _hybrid_scheduler(make_scheduler(max_model_len=max_len), shape(), kv_bytes)
    reqs = [make_request(tokens(n, base), max_tokens=60) for n, base in prompts]
    for req in reqs:
        s.add_request(req)
    fresh = _fresh_blocks(s)
    reading: dict[int, set[int]] = {}  # store job -> the blocks it reads
    loading: list[str] = []  # a preempted request comes back through a load
    preempted = 0
    for _ in range(400):
        fresh.clear()
        # the last step's stores (and loads) land
        out, meta, _ = step(s, stores_done=list(reading), finished_recving=loading)
        in_use = set().union(*reading.values()) if reading else set()
        assert not in_use & set(out.new_block_ids_to_zero or ()), "zeroed under a store"
        assert not in_use & {c.dst_block_id for c in out.kv_cache_block_copies or ()}, (
            "copied into under a store"
        )
        assert not in_use & set(fresh), "handed out again under a store"
        preempted += len(out.preempted_req_ids)
        reading = {j.job_id: {b for b in j.block_ids if b > 0} for j in meta.stores}
        loading = [j.req_id for j in meta.loads]
        if all(r.is_finished() for r in reqs):
            break
    assert all(r.is_finished() for r in reqs)
    if kv_bytes == 48 << 10:
        assert preempted  # the scenario preempted a request
    step(s, stores_done=list(reading))
    assert not kvbm(s)._store_jobs
    assert s.reset_prefix_cache()  # every block a store held was handed back
