"""No store reads an engine block that vLLM has freed, on vLLM's real
Scheduler (the test plays the worker, as in scheduler_harness)."""

from __future__ import annotations

import time

from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (kvbm, make_request, make_scheduler, step, tokens,
                                       worker_output)


def test_a_backlog_of_a_request_preempted_this_step_is_dropped_not_stored(tmp_path):
    """7 usable blocks, a 4-page host tier and a disk tier: two 48-token
    prompts take 3 blocks each; the first gets 3 host slots, the second 1 (its
    other 2 pages wait as its backlog). The first's store fails, so 3 slots
    are free when the first decode step needs 2 more blocks and vLLM preempts
    the second, freeing its blocks: its backlog must be dropped, not stored
    from blocks it no longer has."""
    s = make_scheduler(num_blocks=8, host_blocks=4, disk_cache_dir=str(tmp_path),
                       disk_cache_size="64MiB")
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
    s.update_from_output(out, worker_output(s, out, stores_failed=[jobs[r1.request_id].job_id],
                                            stores_done=[jobs[r2.request_id].job_id]))

    out, meta, _ = step(s)
    assert out.preempted_req_ids == {r2.request_id}
    assert r2.status == RequestStatus.PREEMPTED
    assert not [j for j in meta.stores if j.req_id == r2.request_id]
    assert r2.request_id not in k._backlogged
    assert k.stats.total["store_skipped_blocks"] == 2
