"""Stores reach the lower tiers even when a step computes more pages than the
host tier has free slots: the rest wait as the request's backlog and go
through the host tier as its slots are spilled and freed (vLLM's real
Scheduler; the test plays a worker that finishes every copy within the step)."""

from __future__ import annotations

import time

from helpers.scheduler_harness import (
    BLOCK,
    keys_of,
    kvbm,
    make_request,
    make_scheduler,
    step,
    tokens,
)


def _run(sched, req, timeout: float = 30.0):
    """Steps until ``req`` is gone and the connector idle, reporting each
    step's spills copied in the next; returns every spill and delayed free."""
    k = kvbm(sched)
    spills, freed, done = [], [], []
    deadline = time.monotonic() + timeout
    while req.request_id in sched.requests or k.has_pending_work():
        assert time.monotonic() < deadline, "the request or its stores never finished"
        _, meta, _ = step(sched, complete=True, spills_done=done)
        done = [s.job_id for s in meta.spills]
        spills += meta.spills
        freed += meta.delayed_free_req_ids
        time.sleep(0.002)
    return spills, freed


def test_a_prompt_longer_than_the_host_tier_reaches_the_disk(tmp_path):
    sched = make_scheduler(host_blocks=4, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    prompt = tokens(10 * BLOCK + 3, 71)
    keys = keys_of(sched, prompt)
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    spills, freed = _run(sched, req)
    assert [key for s in spills for key in s.keys] == keys  # every page, in order
    assert all(s.tiers == ["disk"] for s in spills)
    assert k.stats.total["store_skipped_blocks"] == 0
    assert k.stats.total["offload_blocks_d2h"] == 10
    # It finished before its last pages were stored: vLLM kept its blocks.
    assert freed == [req.request_id]
    assert not k._backlogged and req.request_id not in k._reqs


def test_without_a_lower_tier_the_pages_beyond_the_host_tier_are_skipped():
    sched = make_scheduler(host_blocks=4)
    k = kvbm(sched)
    req = make_request(tokens(10 * BLOCK + 3, 72), max_tokens=2)
    sched.add_request(req)
    _run(sched, req)
    assert k.stats.total["offload_blocks_d2h"] == 4
    assert k.stats.total["store_skipped_blocks"] == 6


def test_a_backlog_that_gets_no_slot_is_dropped_and_the_blocks_freed(tmp_path, monkeypatch):
    """Host slots that never come free (the spills are never reported
    copied): the backlog is dropped after BACKLOG_TIMEOUT_S and _STEPS, counted, and the
    finished request's blocks are handed back to vLLM."""
    from vllm_kvbm.scheduler import store_plan

    monkeypatch.setattr(store_plan, "BACKLOG_TIMEOUT_S", 0.3)
    monkeypatch.setattr(store_plan, "BACKLOG_TIMEOUT_STEPS", 3)
    sched = make_scheduler(host_blocks=4, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    req = make_request(tokens(10 * BLOCK + 3, 73), max_tokens=2)
    sched.add_request(req)
    freed = []
    deadline = time.monotonic() + 20
    while req.request_id in sched.requests:
        assert time.monotonic() < deadline, "the request's blocks were never freed"
        _, meta, _ = step(sched, complete=True)  # spills never reported copied
        freed += meta.delayed_free_req_ids
        time.sleep(0.01)
    assert freed == [req.request_id]
    assert k.stats.total["offload_blocks_d2h"] == 4
    assert k.stats.total["store_skipped_blocks"] == 6
