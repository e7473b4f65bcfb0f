"""Scheduler side of KVBMConnector, driven by vLLM's real Scheduler.

No model, no worker: each test plays the worker by reading the connector
metadata vLLM hands out and reporting completions back (see
scheduler_harness.step).
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    block_ids,
    keys_of,
    kvbm,
    load_again,
    make_request,
    make_scheduler,
    run_until_done,
    step,
    store_and_finish,
    tokens,
)


def store_job_ids(meta) -> list[int]:
    return [job.job_id for job in meta.stores]


# ---- 1. host tier LRU -----------------------------------------------------------


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


# ---- 2. transfer failures -------------------------------------------------------


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
    step(
        s,
        finished_recving=[r2.request_id],
        loads_failed=[r2.request_id],
        invalid_block_ids=load.block_ids,
    )
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
    step(
        s,
        finished_recving=[r2.request_id],
        loads_failed=[r2.request_id],
        invalid_block_ids=load.block_ids,
    )
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
    counted, add = [], k.stats.add
    k.stats.add = lambda name, value=1, tier=None: (
        counted.append((name, value, tier)),
        add(name, value, tier),
    )
    step(s, stores_failed=[stuck.job_id], slots_held=stuck.slots, finished_sending=[r1.request_id])
    assert r1.request_id not in s.requests  # its engine blocks are free to reuse
    assert len(k.host) == 0 and k.host.used_slots == 2
    assert k.stats.total["transfer_timeouts"] == 1 and k.stats.total["store_errors"] == 1
    assert ("transfer_timeouts", 1, "overdue") in counted  # by the event the worker named
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


# ---- 3. edge cases --------------------------------------------------------------


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
    assert kvbm(s)._reqs[r1.request_id].chain.keys[1] == keys_of(s, r1.all_token_ids[:32])[1]


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
