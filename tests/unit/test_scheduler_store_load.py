"""Stores and loads through KVBMConnector's scheduler side, driven by vLLM's
real Scheduler: a stored prefix loads back, each block is stored once, and
stores still in flight are never loaded.

No model, no worker: each test plays the worker by reading the connector
metadata vLLM hands out and reporting completions back (see
scheduler_harness.step).
"""

from __future__ import annotations


from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    BLOCK,
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


# ---- host hits loaded layer by layer (worker/layer_copies.py) --------------------


def test_a_host_hit_is_synchronous_once_every_worker_loads_layer_by_layer():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(40, 41)
    r1, load = load_again(s, prompt, max_tokens=1)  # no worker said it can: asynchronous
    assert not load.layered and r1.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, finished_recving=[r1.request_id])
    run_until_done(s, r1.request_id)

    step(s, layered_workers=1)  # the one worker can
    assert s.reset_prefix_cache()
    k.weights.reported([(k.weights.epoch, 0, "")])  # the worker's weights, as loaded
    keys = keys_of(s, prompt)
    r2 = make_request(prompt[:32] + tokens(28, 42), max_tokens=2)
    s.add_request(r2)
    out, meta, _ = step(s, complete=True)
    (load,) = meta.loads
    assert load.layered and load.block_ids == block_ids(s, r2.request_id)[:2]
    # computed in the step that loads it, the loaded blocks counted as computed
    assert r2.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {r2.request_id: 60 - 32}
    assert all(k.host._entries[key].pins == 0 for key in keys)
    assert k.stats.total["onboard_blocks_h2d"] == 4  # both loads
    assert k.stats.total["onboard_layered_blocks"] == 2  # the second


def test_a_failed_layered_load_is_recomputed_and_its_pages_dropped():
    s = make_scheduler()
    k = kvbm(s)
    prompt = tokens(40, 43)
    store_and_finish(s, prompt)
    step(s, layered_workers=1)
    assert s.reset_prefix_cache()
    k.weights.reported([(k.weights.epoch, 0, "")])  # the worker's weights, as loaded
    keys = keys_of(s, prompt)
    r = make_request(prompt, max_tokens=2)
    s.add_request(r)
    out = s.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.layered and out.num_scheduled_tokens == {r.request_id: 40 - 32}
    from helpers.scheduler_harness import worker_output

    mro = worker_output(
        s,
        out,
        loads_failed=[r.request_id],
        loads_done=[r.request_id],
        invalid_block_ids=load.block_ids,
    )
    s.update_from_output(out, mro)
    # vLLM drops the step's token and recomputes from the first failed block
    assert r.num_computed_tokens == 0 and not r.output_token_ids
    assert not any(key in k.host for key in keys)  # the bytes may be bad: forgotten
    assert k.stats.total["load_error_blocks"] == 2
    out, meta, _ = step(s)
    assert out.num_scheduled_tokens == {r.request_id: 40} and not meta.loads
