"""When vLLM may free a request's blocks while KVBM still stores them: the
delayed free of a finished request, and preemption under memory pressure,
driven by vLLM's real Scheduler.

No model, no worker: each test plays the worker by reading the connector
metadata vLLM hands out and reporting completions back (see
scheduler_harness.step).
"""

from __future__ import annotations


import pytest
from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    block_ids,
    kvbm,
    make_request,
    make_scheduler,
    step,
    store_and_finish,
    tokens,
)


def store_job_ids(meta) -> list[int]:
    return [job.job_id for job in meta.stores]


# ---- 1. delayed free ------------------------------------------------------------


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


# ---- 2. preemption --------------------------------------------------------------


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
