"""Scheduler side of KVBMConnector, driven by vLLM's real Scheduler.

No model, no worker: each test plays the worker by reading the connector
metadata vLLM hands out and reporting completions back (see
scheduler_harness.step).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (BLOCK, block_ids, keys_of, kvbm, load_again, lookup,
                                       make_request, make_scheduler, run_until_done, step,
                                       store_and_finish, tokens)
from vllm_kvbm.keys import KeyChain, KeyNamespace, LoRAIdentity, request_salt


def store_job_ids(meta) -> list[int]:
    return [job.job_id for job in meta.stores]


# ---- 1. store, then load the same prefix --------------------------------------


def test_store_then_async_load_roundtrip():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(40, 1)  # 2 full blocks + an 8-token tail
    r1 = make_request(prompt, max_tokens=3)
    s.add_request(r1)

    _, meta, _ = step(s)
    assert len(meta.stores) == 1 and not meta.loads
    job = meta.stores[0]
    assert job.req_id == r1.request_id
    assert job.block_ids == block_ids(s, r1.request_id)[:2]  # tail block never stored
    assert len(set(job.slots)) == 2
    keys = keys_of(s, prompt)
    assert len(keys) == 2
    # Written but not reported: nothing is loadable yet.
    assert not any(k.host.is_ready(key) for key in keys)

    _, meta, _ = step(s, stores_done=[job.job_id])
    assert all(k.host.is_ready(key) for key in keys)
    assert k.stats.total["offload_blocks_d2h"] == 2
    run_until_done(s, r1.request_id)
    assert r1.request_id not in s.requests
    assert s.reset_prefix_cache()  # the engine forgets; the host tier does not

    # Same prefix, different suffix: 2 host blocks + 28 new tokens.
    r2 = make_request(prompt[:32] + tokens(28, 2), max_tokens=2)
    s.add_request(r2)
    out, meta, _ = step(s)
    assert r2.request_id not in out.num_scheduled_tokens
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(meta.loads) == 1 and not meta.stores
    load = meta.loads[0]
    assert load.req_id == r2.request_id
    assert load.slots == job.slots
    assert load.block_ids == block_ids(s, r2.request_id)[:2]
    assert k.stats.total["matched_tokens"] == 32
    assert all(k.host._entries[key].pins == 1 for key in keys)

    # Not reported yet: it keeps waiting.
    out, meta, _ = step(s)
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.num_scheduled_tokens and not meta.loads

    step(s, finished_recving=[r2.request_id])
    assert all(k.host._entries[key].pins == 0 for key in keys)
    assert k.stats.total["onboard_blocks_h2d"] == 2
    out, meta, _ = step(s)
    assert r2.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {r2.request_id: 60 - 32}
    # Only the newly computed third block is stored, never the loaded ones.
    assert [j.block_ids for j in meta.stores] == [[block_ids(s, r2.request_id)[2]]]
    assert k.stats.total["offload_blocks_d2h"] == 2


def test_host_hit_beyond_a_partial_local_hit():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(56, 26)  # 3 full blocks + 8
    _, metas = store_and_finish(s, prompt)
    stored_slots = [slot for m in metas for j in m.stores for slot in j.slots]
    assert len(stored_slots) == 3
    assert s.reset_prefix_cache()
    # Warm the engine's prefix cache with block 0 only (itself a host hit).
    store_and_finish(s, prompt[:16] + tokens(10, 27), max_tokens=1)
    matched_before = k.stats.total["matched_tokens"]
    r2 = make_request(prompt, max_tokens=1)
    s.add_request(r2)
    _, meta, _ = step(s)
    (load,) = meta.loads
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert load.slots == stored_slots[1:3]
    assert load.block_ids == block_ids(s, r2.request_id)[1:3]
    assert k.stats.total["matched_tokens"] - matched_before == 32
    step(s, finished_recving=[r2.request_id])
    out, _, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: 56 - 48}


def test_abort_during_load_unpins_when_the_load_ends():
    s = make_scheduler(num_blocks=64)
    k = kvbm(s)
    prompt = tokens(40, 37)
    r2, load = load_again(s, prompt, max_tokens=2)
    s.finish_requests(r2.request_id, RequestStatus.FINISHED_ABORTED)
    # The worker may still be writing into r2's blocks: vLLM keeps them, and
    # the host slots stay pinned.
    assert r2.request_id in s.requests
    assert all(k.host._entries[key].pins == 1 for key in keys_of(s, prompt))
    step(s, finished_recving=[r2.request_id])
    assert r2.request_id not in s.requests and r2.request_id not in k._reqs
    assert all(k.host._entries[key].pins == 0 for key in keys_of(s, prompt))
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64 - 1
    assert not k.has_pending_work()


def test_two_requests_loading_the_same_stored_prefix_at_once():
    s = make_scheduler(host_blocks=4, num_blocks=64)
    k = kvbm(s)
    prefix = tokens(32, 49)
    store_and_finish(s, prefix + tokens(4, 50))
    assert s.reset_prefix_cache()
    ra = make_request(prefix + tokens(10, 51), max_tokens=1)
    rb = make_request(prefix + tokens(10, 52), max_tokens=1)
    s.add_request(ra)
    s.add_request(rb)
    _, meta, _ = step(s)
    loads = {job.req_id: job for job in meta.loads}
    assert set(loads) == {ra.request_id, rb.request_id}
    assert loads[ra.request_id].slots == loads[rb.request_id].slots  # same host pages
    assert not set(loads[ra.request_id].block_ids) & set(loads[rb.request_id].block_ids)
    keys = keys_of(s, prefix)
    assert [k.host._entries[key].pins for key in keys] == [2, 2]
    # rb is aborted mid-load; ra's load ends: the pages stay pinned for rb's.
    s.finish_requests(rb.request_id, RequestStatus.FINISHED_ABORTED)
    step(s, finished_recving=[ra.request_id])
    assert [k.host._entries[key].pins for key in keys] == [1, 1]
    # Host tier pressure meanwhile never evicts pages still being read.
    for base in (53, 54):
        store_and_finish(s, tokens(40, base), max_tokens=1)
    assert all(k.host.is_ready(key) for key in keys)
    step(s, finished_recving=[rb.request_id])
    assert [k.host._entries[key].pins for key in keys] == [0, 0]
    assert rb.request_id not in s.requests and rb.request_id not in k._reqs


# ---- 2. no double stores ------------------------------------------------------


def test_shared_prefix_in_one_batch_is_stored_once():
    s = make_scheduler()
    prefix = tokens(32, 3)
    ra = make_request(prefix + tokens(20, 4), max_tokens=2)
    rb = make_request(prefix + tokens(20, 5), max_tokens=2)
    s.add_request(ra)
    s.add_request(rb)
    out, meta, _ = step(s)
    assert set(out.num_scheduled_tokens) == {ra.request_id, rb.request_id}
    stored_slots = [slot for j in meta.stores for slot in j.slots]
    assert len(stored_slots) == len(set(stored_slots)) == 4  # 2 shared + 1 + 1
    by_req = {j.req_id: j for j in meta.stores}
    assert by_req[ra.request_id].block_ids == block_ids(s, ra.request_id)[:3]
    # rb shares blocks 0-1 (being stored by ra's job): only its own block 2.
    assert by_req[rb.request_id].block_ids == [block_ids(s, rb.request_id)[2]]
    assert len(kvbm(s).host) == 4


def test_block_already_in_host_is_not_stored_again():
    s = make_scheduler()
    prefix = tokens(32, 6)
    store_and_finish(s, prefix + tokens(4, 7))
    assert kvbm(s).stats.total["offload_blocks_d2h"] == 2
    # Same prefix, engine cache still warm: the new request computes only its
    # third block, and the two host-resident ones are not planned again.
    rc = make_request(prefix + tokens(20, 8), max_tokens=1)
    s.add_request(rc)
    _, meta, _ = step(s)
    assert [j.block_ids for j in meta.stores] == [[block_ids(s, rc.request_id)[2]]]


# ---- 3. stores in flight are invisible ----------------------------------------


def test_unreported_stores_are_not_loadable():
    s = make_scheduler(max_batched=32)  # 32-token chunks: one store job per chunk
    k = kvbm(s)
    prompt = tokens(70, 9)
    r1 = make_request(prompt, max_tokens=1)
    s.add_request(r1)
    jobs = []
    for _ in range(3):
        _, meta, _ = step(s)
        jobs += meta.stores
    assert [len(j.block_ids) for j in jobs] == [2, 2]
    probe = make_request(prompt)  # never added: asks the connector directly
    # Nothing is loadable while the stores run: the lookup says "ask again"
    # (None) rather than recompute what will be in the host tier shortly.
    assert k.get_num_new_matched_tokens(probe, 0) == (None, False)
    # The later chunk finishing first does not expose a hole-y prefix.
    step(s, stores_done=[jobs[1].job_id])
    assert k.get_num_new_matched_tokens(probe, 0) == (None, False)
    step(s, stores_done=[jobs[0].job_id])
    # 70 tokens: 4 full blocks, all loadable (leaves tokens 64..69 to compute).
    assert k.get_num_new_matched_tokens(probe, 0) == (64, True)
    # Beyond a local hit of 1 block only 3 more are reported.
    assert k.get_num_new_matched_tokens(probe, BLOCK) == (48, True)


# ---- 4. delayed free ------------------------------------------------------------


def test_finish_with_stores_in_flight_delays_block_free():
    s = make_scheduler(num_blocks=64)
    k = kvbm(s)
    pool = s.kv_cache_manager.block_pool
    r1 = make_request(tokens(40, 10), max_tokens=1)
    s.add_request(r1)
    rid = r1.request_id
    _, meta, _ = step(s)  # prefill + the one output token: finished
    job = meta.stores[0]
    assert r1.is_finished()
    assert rid in s.requests, "blocks must stay allocated while stores read them"
    held = block_ids(s, rid)
    assert held and all(pool.blocks[b].ref_cnt == 1 for b in held)
    assert k.has_pending_work()

    _, meta, _ = step(s)
    assert meta.delayed_free_req_ids == [rid]
    _, meta, _ = step(s, stores_done=[job.job_id])
    assert meta.delayed_free_req_ids == []
    assert rid in s.requests, "freed before the worker reported finished_sending"
    assert rid not in k._reqs  # connector state is gone once stores are done
    step(s, finished_sending=[rid])
    assert rid not in s.requests
    assert all(pool.blocks[b].ref_cnt == 0 for b in held)
    assert pool.get_num_free_blocks() == 64 - 1
    assert not k.has_pending_work()


def test_finish_without_stores_in_flight_frees_at_once():
    s = make_scheduler()
    r1 = make_request(tokens(40, 11), max_tokens=3)
    s.add_request(r1)
    _, meta, _ = step(s)
    step(s, stores_done=store_job_ids(meta))
    step(s)  # third output token: finished, nothing in flight
    assert r1.request_id not in s.requests
    assert not kvbm(s).has_pending_work() and not kvbm(s)._reqs


def test_stores_reported_in_the_finishing_step_still_need_finished_sending():
    # vLLM calls request_finished before it hands the step's connector output
    # to the connector, so stores done in that same step still delay the free.
    s = make_scheduler()
    r1 = make_request(tokens(40, 25), max_tokens=2)
    s.add_request(r1)
    _, meta, _ = step(s)
    step(s, stores_done=store_job_ids(meta))
    assert r1.is_finished() and r1.request_id in s.requests
    _, meta, _ = step(s)
    assert meta.delayed_free_req_ids == [r1.request_id]
    step(s, finished_sending=[r1.request_id])
    assert r1.request_id not in s.requests
    assert not kvbm(s).has_pending_work() and not kvbm(s)._reqs


# ---- 5. preemption --------------------------------------------------------------


def test_memory_pressure_preempts_running_requests_never_one_whose_load_is_in_flight():
    # vLLM preempts only RUNNING requests; one waiting for its KV load keeps
    # its blocks (NIXL is writing them) whatever the pressure.
    s = make_scheduler(num_blocks=8, host_blocks=16)  # 7 usable blocks
    prefix = tokens(32, 56)
    store_and_finish(s, prefix + tokens(4, 57), max_tokens=1)
    assert s.reset_prefix_cache()
    runner = make_request(tokens(48, 58), max_tokens=40)
    s.add_request(runner)
    step(s, complete=True)
    loader = make_request(prefix + tokens(8, 59), max_tokens=2)
    s.add_request(loader)
    _, meta, _ = step(s)
    assert [job.req_id for job in meta.loads] == [loader.request_id]
    held = block_ids(s, loader.request_id)
    pool = s.kv_cache_manager.block_pool
    preempted = set()
    for _ in range(40):  # the runner decodes until it needs a block none has
        out, meta, _ = step(s, stores_done=[j.job_id for j in meta.stores])
        preempted |= out.preempted_req_ids
        assert loader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert block_ids(s, loader.request_id) == held
        assert all(pool.blocks[b].ref_cnt == 1 for b in held)
        if preempted:
            break
    assert preempted == {runner.request_id}
    step(s, finished_recving=[loader.request_id])
    out, _, _ = step(s)
    assert out.num_scheduled_tokens.get(loader.request_id) == 40 - 32


@pytest.mark.parametrize("stores_reported", [False, True])
def test_preempted_request_with_stores_in_flight_is_flushed(stores_reported):
    # 7 usable blocks: two 48-token prompts take 3 each; the first decode step
    # needs 2 more, so the real scheduler preempts the second request.
    s = make_scheduler(num_blocks=8)
    r1 = make_request(tokens(48, 12), max_tokens=20)
    r2 = make_request(tokens(48, 13), max_tokens=20)
    s.add_request(r1)
    s.add_request(r2)
    _, meta, _ = step(s, complete=stores_reported)
    jobs = {j.req_id: j for j in meta.stores}
    assert set(jobs) == {r1.request_id, r2.request_id}
    assert len(jobs[r2.request_id].block_ids) == 3
    out, meta, _ = step(s)
    assert out.preempted_req_ids == {r2.request_id}
    assert r2.status == RequestStatus.PREEMPTED
    if stores_reported:
        assert meta.flush_req_ids == []
    else:
        assert meta.flush_req_ids == [r2.request_id]
        step(s, stores_done=[j.job_id for j in jobs.values()])

    # The preempted request comes back through the host tier: free the engine
    # (abort r1, drop its prefix cache) and r2's 3 blocks are loaded, not
    # recomputed (its 49th token still is).
    s.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache()
    _, meta, _ = step(s)
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [j.slots for j in meta.loads] == [jobs[r2.request_id].slots]
    step(s, finished_recving=[r2.request_id])
    out, meta, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: 1}
    assert not meta.stores


# ---- 6. host tier LRU -----------------------------------------------------------


def test_lru_eviction_order_and_counter():
    s = make_scheduler(host_blocks=4)
    k = kvbm(s)
    p1, p2, p3 = tokens(40, 14), tokens(40, 15), tokens(40, 16)
    store_and_finish(s, p1)
    store_and_finish(s, p2)
    assert k.host.used_slots == 4 and k.stats.total["host_evictions"] == 0
    store_and_finish(s, p3)
    assert k.stats.total["host_evictions"] == 2
    assert not any(key in k.host for key in keys_of(s, p1))  # oldest went first
    assert all(k.host.is_ready(key) for key in keys_of(s, p2) + keys_of(s, p3))


def test_load_refreshes_lru_position():
    s = make_scheduler(host_blocks=4)
    k = kvbm(s)
    p1, p2, p3 = tokens(40, 28), tokens(40, 29), tokens(40, 30)
    store_and_finish(s, p1)
    store_and_finish(s, p2)
    assert s.reset_prefix_cache()
    loader = make_request(p1, max_tokens=1)  # p1 is used again: now the newest
    s.add_request(loader)
    step(s)
    step(s, finished_recving=[loader.request_id])
    run_until_done(s, loader.request_id)
    store_and_finish(s, p3)
    assert all(k.host.is_ready(key) for key in keys_of(s, p1) + keys_of(s, p3))
    assert not any(key in k.host for key in keys_of(s, p2))


def test_pinned_slots_are_never_evicted():
    s = make_scheduler(host_blocks=2)
    k = kvbm(s)
    p1 = tokens(40, 17)
    loader, load = load_again(s, p1, max_tokens=1)
    # Host is full and every slot is being read: a new prompt's blocks are
    # skipped rather than overwriting the slots under the load.
    r3 = make_request(tokens(40, 18), max_tokens=1)
    s.add_request(r3)
    _, meta, _ = step(s)
    assert meta.stores == []
    assert k.stats.total["store_skipped_blocks"] == 2
    assert k.stats.total["host_evictions"] == 0
    assert [k.host._entries[key].slot for key in keys_of(s, p1)] == load.slots
    # Once the load is done the slots are ordinary LRU entries again.
    step(s, finished_recving=[loader.request_id])
    r4 = make_request(tokens(40, 19), max_tokens=1)
    s.add_request(r4)
    _, meta, _ = step(s)
    assert sorted(meta.stores[0].slots) == sorted(load.slots)
    step(s, stores_done=store_job_ids(meta))
    assert k.stats.total["host_evictions"] == 2
    assert not any(key in k.host for key in keys_of(s, p1))


# ---- 7. transfer failures -------------------------------------------------------


def test_failed_store_leaves_no_entry():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(40, 20)
    r1 = make_request(prompt, max_tokens=3)
    s.add_request(r1)
    _, meta, _ = step(s)
    step(s, stores_failed=store_job_ids(meta))
    assert len(k.host) == 0 and k.host.used_slots == 0
    assert k.stats.total["store_errors"] == 1
    assert k.stats.total["offload_blocks_d2h"] == 0
    assert k.get_num_new_matched_tokens(make_request(prompt), 0) == (0, False)


def test_failed_load_drops_keys_and_recomputes():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(40, 21)
    r2, load = load_again(s, prompt, max_tokens=2)
    step(s, finished_recving=[r2.request_id], loads_failed=[r2.request_id],
         invalid_block_ids=load.block_ids)
    assert not any(key in k.host for key in keys_of(s, prompt))
    assert k.stats.total["load_error_blocks"] == 2
    assert k.stats.total["onboard_blocks_h2d"] == 0
    # vLLM recomputes the whole prompt; the recomputed blocks refill the tier.
    out, meta, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: 40}
    assert [j.block_ids for j in meta.stores] == [block_ids(s, r2.request_id)[:2]]


def test_a_failed_load_recomputes_until_the_request_is_preempted_then_loads_again():
    # After a failed load the request recomputes (a tier that keeps failing
    # on a page it lists would otherwise send it round load, fail, look up
    # forever); once preempted, its KV is gone and it may load again.
    s = make_scheduler(num_blocks=8)  # 7 usable blocks of 16 tokens
    k = kvbm(s)
    prompt = tokens(48, 71)
    store_and_finish(s, prompt)
    assert s.reset_prefix_cache()
    r1 = make_request(tokens(48, 72), max_tokens=20)
    s.add_request(r1)
    step(s, complete=True)
    r2 = make_request(prompt, max_tokens=20)
    s.add_request(r2)
    _, meta, _ = step(s)
    (load,) = meta.loads
    step(s, finished_recving=[r2.request_id], loads_failed=[r2.request_id],
         invalid_block_ids=load.block_ids)
    assert k.get_num_new_matched_tokens(r2, 0) == (0, False)  # recomputes
    preempted = set()
    for _ in range(20):  # both decode until one needs a block none has
        out, _, _ = step(s, complete=True)
        preempted |= out.preempted_req_ids
        if preempted:
            break
    assert preempted == {r2.request_id}
    # Its recomputed blocks were stored again: it loads them now.
    s.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache()
    _, meta, _ = step(s)
    assert [j.req_id for j in meta.loads] == [r2.request_id]
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_overdue_store_slots_are_not_reused_until_released():
    # The worker reports a store past its timeout as failed, with its slots
    # held: a late NIXL write may still land there, so no block may get them.
    s = make_scheduler(host_blocks=4)
    k = kvbm(s)
    r1 = make_request(tokens(40, 42), max_tokens=1)
    s.add_request(r1)
    _, meta, _ = step(s)
    (stuck,) = meta.stores
    step(s, stores_failed=[stuck.job_id], slots_held=stuck.slots,
         finished_sending=[r1.request_id])
    assert r1.request_id not in s.requests  # its engine blocks are free to reuse
    assert len(k.host) == 0 and k.host.used_slots == 2
    assert k.stats.total["transfer_timeouts"] == 1 and k.stats.total["store_errors"] == 1
    # Other prompts churn the 2 remaining slots and never get the held ones.
    for base in (43, 44, 45):
        _, metas = store_and_finish(s, tokens(40, base), max_tokens=1)
        slots = [slot for m in metas for j in m.stores for slot in j.slots]
        assert slots and not set(slots) & set(stuck.slots)
    assert len(k.host._held) == 2
    step(s, slots_released=stuck.slots)
    assert len(k.host._held) == 0 and k.host.used_slots == 2
    _, metas = store_and_finish(s, tokens(72, 46), max_tokens=1)  # 4 blocks
    assert sorted(slot for m in metas for j in m.stores for slot in j.slots) == [0, 1, 2, 3]


def test_store_needs_every_worker_and_one_failed_rank_drops_it():
    s = make_scheduler()
    k = kvbm(s)
    k.info = dataclasses.replace(k.info, num_workers=2)  # as with TP=2
    prompt = tokens(40, 31)
    r1 = make_request(prompt, max_tokens=4)
    s.add_request(r1)
    _, meta, _ = step(s)
    (job,) = meta.stores
    step(s, stores_done=[job.job_id])  # rank 0 only
    assert not any(k.host.is_ready(key) for key in keys_of(s, prompt))
    step(s, stores_failed=[job.job_id])  # rank 1 failed: the pages are partial
    assert not any(key in k.host for key in keys_of(s, prompt))
    assert k.stats.total["store_errors"] == 1

    r2 = make_request(tokens(40, 32), max_tokens=3)
    s.add_request(r2)
    _, meta, _ = step(s)
    (job,) = meta.stores
    step(s, stores_failed=[job.job_id])
    step(s, stores_done=[job.job_id])  # a later success does not undo the failure
    assert not any(key in k.host for key in keys_of(s, tokens(40, 32)))
    assert k.stats.total["store_errors"] == 2


def test_connector_reset_forgets_stores_still_in_flight():
    # pause_generation(clear_cache=True) around a weight update: running
    # requests are preempted and every cache reset. A store posted before the
    # reset holds KV of the old weights and must not become loadable after it.
    s = make_scheduler()
    k = kvbm(s)
    old, fresh = tokens(40, 35), tokens(40, 36)
    store_and_finish(s, old)
    writer = make_request(fresh, max_tokens=8)
    s.add_request(writer)
    _, meta, _ = step(s)
    (store,) = meta.stores
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert not any(key in k.host for key in keys_of(s, old))
    step(s, stores_done=[store.job_id])
    assert not any(k.host.is_ready(key) for key in keys_of(s, fresh))
    # No hit: at most "ask again" while the preempted writer, recomputing
    # from scratch, stores its post-reset KV (under the same keys: the
    # weights did not change).
    hit, _ = k.get_num_new_matched_tokens(make_request(fresh), 0)
    assert not hit


def test_a_reset_vllm_refuses_during_a_load_keeps_it_then_a_later_reset_forgets_it():
    s = make_scheduler(num_blocks=64)
    k = kvbm(s)
    prompt = tokens(40, 47)
    r2, load = load_again(s, prompt, max_tokens=2)
    held = block_ids(s, r2.request_id)
    pool = s.kv_cache_manager.block_pool
    keys = keys_of(s, prompt)
    # The load holds engine blocks: vLLM refuses the local reset, and with
    # reset_running_requests it raises (vLLM 0.32 does not support resetting
    # under a pending KV load); neither frees the blocks being written.
    with pytest.raises(RuntimeError, match="waiting for remote KV"):
        s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    # vLLM keeps its cache, so KVBM keeps its own: the load goes on.
    assert not s.reset_prefix_cache(reset_connector=True)
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)
    assert keys_of(s, prompt) == keys
    step(s, finished_recving=[r2.request_id])
    run_until_done(s, r2.request_id)
    step(s, complete=True)
    assert r2.request_id not in s.requests
    # Idle again: the full reset goes through, and the prompt is recomputed.
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert len(k.host) == 0 and k.host.used_slots == 0
    r3 = make_request(prompt, max_tokens=1)
    s.add_request(r3)
    out, meta, _ = step(s)
    assert not meta.loads and out.num_scheduled_tokens == {r3.request_id: 40}


def test_a_reset_refused_for_a_delayed_free_keeps_its_stores_until_a_granted_one():
    s = make_scheduler(num_blocks=64)
    k = kvbm(s)
    r1 = make_request(tokens(40, 48), max_tokens=1)
    s.add_request(r1)
    _, meta, _ = step(s)  # prefill + its only token: finished, stores in flight
    (store,) = meta.stores
    held = block_ids(s, r1.request_id)
    assert r1.is_finished() and r1.request_id in s.requests
    assert not s.reset_prefix_cache(reset_connector=True)  # blocks still read
    assert all(s.kv_cache_manager.block_pool.blocks[b].ref_cnt == 1 for b in held)
    _, meta, _ = step(s, stores_done=[store.job_id])
    # The reset vLLM refused changed nothing: the store lands under the keys
    # its KV was computed for, as vLLM's own cache still serves that KV.
    keys = keys_of(s, tokens(40, 48))
    assert all(k.host.is_ready(key) for key in keys[:2])
    assert meta.delayed_free_req_ids == [r1.request_id]
    step(s, finished_sending=meta.delayed_free_req_ids)
    assert r1.request_id not in s.requests
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert k.host.used_slots == 0 and not k.has_pending_work()
    assert not any(k.host.is_ready(key) for key in keys_of(s, tokens(40, 48)))


# ---- 8. edge cases --------------------------------------------------------------


def test_prompt_shorter_than_a_block():
    s = make_scheduler()
    k = kvbm(s)
    r1 = make_request(tokens(10, 22), max_tokens=1)
    s.add_request(r1)
    _, meta, _ = step(s)
    assert meta.stores == [] and meta.loads == []
    assert r1.request_id not in s.requests  # no delayed free: nothing stored
    assert not k._reqs and len(k.host) == 0
    assert k.get_num_new_matched_tokens(make_request(tokens(10, 22)), 0) == (0, False)


def test_prompt_of_whole_blocks_leaves_one_token_to_compute():
    s = make_scheduler()
    prompt = tokens(32, 23)
    _, metas = store_and_finish(s, prompt, max_tokens=1)
    assert sum(len(j.block_ids) for m in metas for j in m.stores) == 2
    assert s.reset_prefix_cache()
    r2 = make_request(prompt, max_tokens=1)
    s.add_request(r2)
    _, meta, _ = step(s)
    (load,) = meta.loads
    assert len(load.block_ids) == 1  # (32 - 1) // 16 blocks at most
    step(s, finished_recving=[r2.request_id])
    out, meta, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: 16}
    assert meta.stores == []  # block 2 is in the host already
    assert r2.is_finished()


@pytest.mark.parametrize("offload_decode", [False, True])
def test_block_completed_by_output_tokens(offload_decode):
    s = make_scheduler(offload_decode_blocks=offload_decode)
    r1 = make_request(tokens(30, 24), max_tokens=4)
    s.add_request(r1)
    stores = []
    for _ in range(3):  # prefill 30, then decode tokens 31 and 32
        _, meta, _ = step(s)
        stores.append([j.block_ids for j in meta.stores])
    bids = block_ids(s, r1.request_id)
    if not offload_decode:  # the default: only prompt blocks are offloaded
        assert stores == [[[bids[0]]], [], []]
        return
    assert stores == [[[bids[0]]], [], [[bids[1]]]]
    # The key covers the sampled tokens, not just the prompt.
    assert kvbm(s)._reqs[r1.request_id].chain.keys[1] == \
        keys_of(s, r1.all_token_ids[:32])[1]


def test_lookup_counted_once_when_admission_is_retried():
    # 7 usable blocks, all taken by r1: r2 is looked up every step but cannot
    # be admitted; it is counted once, when it is admitted, with what it loads
    # then (stores that finished meanwhile count), as vLLM counts its queries.
    s = make_scheduler(num_blocks=8)
    k = kvbm(s)
    shared = tokens(32, 34)
    store_and_finish(s, shared + tokens(8, 38), max_tokens=1)
    assert s.reset_prefix_cache()
    lookups, matched = k.stats.total["lookup_tokens"], k.stats.total["matched_tokens"]
    r1 = make_request(tokens(100, 33), max_tokens=3)
    r2 = make_request(shared + tokens(8, 39), max_tokens=1)
    s.add_request(r1)
    s.add_request(r2)
    for _ in range(2):
        out, _, _ = step(s, complete=True)
        assert r2.request_id not in out.num_scheduled_tokens
    assert k.stats.total["lookup_tokens"] - lookups == 100  # r2 not admitted yet
    run_until_done(s, r1.request_id)
    _, meta, _ = step(s)
    assert [job.req_id for job in meta.loads] == [r2.request_id]
    assert k.stats.total["lookup_tokens"] - lookups == 100 + 40
    assert k.stats.total["matched_tokens"] - matched == 32
    assert k.stats.total["matched_tokens_host"] == 32  # the first lookup found none
    step(s, finished_recving=[r2.request_id])
    run_until_done(s, r2.request_id)
    assert k.stats.total["lookup_tokens"] - lookups == 100 + 40


def test_resumed_preempted_request_is_not_counted_again():
    s = make_scheduler(num_blocks=8)
    k = kvbm(s)
    r1 = make_request(tokens(48, 40), max_tokens=20)
    r2 = make_request(tokens(48, 41), max_tokens=20)
    s.add_request(r1)
    s.add_request(r2)
    step(s, complete=True)
    out, _, _ = step(s, complete=True)
    assert out.preempted_req_ids == {r2.request_id}
    assert k.stats.total["lookup_tokens"] == 96
    s.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache()
    _, meta, _ = step(s, complete=True)  # r2 resumes, loading its stored blocks
    assert [job.req_id for job in meta.loads] == [r2.request_id]
    assert k.stats.total["lookup_tokens"] == 96
    assert k.stats.total["matched_tokens"] == 0
    assert k.stats.total["onboard_blocks_h2d"] == 3


def test_metrics_port_already_taken_is_a_warning_not_a_failure(caplog):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("WARNING", logger="vllm_kvbm.connector"):
            s = make_scheduler(metrics_port=port, metrics_host="127.0.0.1")
    assert kvbm(s).stats.sink is None
    assert f"metrics_port {port} unavailable" in caplog.text
    store_and_finish(s, tokens(40, 55))  # the connector works without it
    assert kvbm(s).stats.total["offload_blocks_d2h"] == 2


# ---- 9. keys --------------------------------------------------------------------

_NS = dict(model="m@", dtype="torch.float16", kv_layout="NHD", block_size=16,
           page_bytes=4096, tp_size=1, extra="")
_TOKENS = list(range(100, 164))


def _first_key(block_size: int = 16, salt: bytes = b"", **changes) -> bytes:
    ns = KeyNamespace(**{**_NS, "block_size": block_size, **changes})
    return KeyChain(ns.seed(), block_size, salt).extend(_TOKENS)[0]


_LORA = LoRAIdentity("lora-a", 1, "/adapters/a", "f1")


@pytest.mark.parametrize("change", [
    dict(model="other@"), dict(dtype="torch.bfloat16"), dict(extra="tenant-b"),
    dict(block_size=32), dict(kv_layout="HND"), dict(tp_size=2),
    # every fp8 KV cache has torch dtype uint8: vLLM's kv-cache-dtype tells them apart
    dict(kv_cache_dtype='["fp8_e5m2", []]'), dict(quantization="fp8"),
    dict(model_fingerprint="new-weights-same-path"),
    # the same page of 256 tokens laid out in blocks of 32 or of 64 tokens
    dict(block_size=32, page_blocks=8), dict(page_blocks=2),
    dict(kv_spec='{"groups": []}'), dict(config="another-vllm-setting"),
    dict(salt=request_salt(_LORA, None)), dict(salt=request_salt(None, "salt")),
])
def test_keys_differ_when_kv_would(change):
    assert _first_key(**change) != _first_key()


@pytest.mark.parametrize("other", [
    LoRAIdentity("lora-a", 2, "/adapters/a", "f1"),      # same name, other adapter id
    LoRAIdentity("lora-a", 1, "/adapters/b", "f1"),      # same name, other path
    LoRAIdentity("lora-a", 1, "/adapters/a", "f2"),      # same path, new weights
])
def test_lora_identity_is_more_than_its_name(other):
    assert request_salt(other, None) != request_salt(_LORA, None)


def test_request_salt_encoding_is_unambiguous():
    """The old "name|salt" join made these two requests share keys."""
    a = request_salt(LoRAIdentity("x|y", 1, ""), "z")
    b = request_salt(LoRAIdentity("x", 1, ""), "y|z")
    assert a != b
    assert request_salt(None, "|") != request_salt(None, "")


def test_keys_chain_over_the_prefix():
    ns = KeyNamespace(**_NS)
    a = KeyChain(ns.seed(), 16).extend(_TOKENS)
    b = KeyChain(ns.seed(), 16).extend(_TOKENS[:16] + [0] + _TOKENS[17:])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    # Incremental extension gives the same keys as one call.
    c = KeyChain(ns.seed(), 16)
    c.extend(_TOKENS[:20])
    assert c.extend(_TOKENS) == a


def test_keys_stable_across_processes():
    code = ("from vllm_kvbm.keys import KeyChain, KeyNamespace\n"
            f"ns = KeyNamespace(**{_NS!r})\n"
            f"print(KeyChain(ns.seed(), 16).extend({_TOKENS!r})[-1].hex())\n")
    here = KeyChain(KeyNamespace(**_NS).seed(), 16).extend(_TOKENS)[-1].hex()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert got == here


def test_a_lora_adapter_changed_on_disk_is_no_longer_cached(tmp_path, caplog):
    """vLLM runs the adapter weights it loaded for an int id until it reloads
    them at a time the scheduler cannot see: once the files change, the
    adapter's requests are not cached (no lookup, no stores, those in flight
    store nothing more), with a warning that says how to cache it again. An
    adapter loaded under a new int id is cached."""
    import logging

    from vllm.lora.request import LoRARequest

    from helpers.scheduler_harness import (fingerprinted, kvbm, make_request, make_scheduler,
                                           tokens)

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"old weights")
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 91)
    first = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
    fingerprinted(k, first.lora_request)
    assert k.get_num_new_matched_tokens(first, 0) == (0, False)
    assert not k._reqs[first.request_id].no_store

    (adapter / "adapter_model.safetensors").write_bytes(b"new weights")
    fingerprinted(k, first.lora_request)  # as after the next request, in the background
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.scheduler.lora_adapters"):
        second = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
        assert k.get_num_new_matched_tokens(second, 0) == (0, False)
    assert second.request_id not in k._reqs  # not tracked: nothing looked up or stored
    assert k._reqs[first.request_id].no_store
    assert "changed on disk" in caplog.text and "new adapter name" in caplog.text
    third = make_request(prompt, lora_request=LoRARequest("tuned", 1, str(adapter)))
    k.get_num_new_matched_tokens(third, 0)
    assert third.request_id not in k._reqs
    assert caplog.text.count("changed on disk") == 1  # warned once

    renamed = make_request(prompt, lora_request=LoRARequest("tuned-v2", 2, str(adapter)))
    fingerprinted(k, renamed.lora_request)
    k.get_num_new_matched_tokens(renamed, 0)
    assert not k._reqs[renamed.request_id].no_store
