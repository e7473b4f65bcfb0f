"""A wait for the lower tiers' answer is bounded by what the answer can save.

vLLM's real Scheduler with KVBM and a real LMCache server, frozen (SIGSTOP):
a lookup behind it would wait remote_timeout_s. With a learned prefill model
a request waits at most what recomputing the pages asked about costs, then
goes on (the host part loaded, the rest recomputed); requests held by the
same frozen server leave at their own times; an answer that comes after its
request went on serves the next request with the same pages at once. Once
the server has answered healthy lookups, a frozen one is noticed as overdue
and a request waits only a share of its saving.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    BLOCK,
    keys_of,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    step,
    tokens,
)
from helpers.tier_pages import put_where_the_scheduler_sees
from vllm_kvbm.tiers.lm.store import RemoteStore

# Far above the wait bound below: a request that waits for it failed the test.
REMOTE_TIMEOUT_S = 30.0
# The prefill model taught below: this many seconds per prompt token.
SECONDS_PER_TOKEN = 1.0 / 128
PAGES = 8  # a prompt of 8 pages and a token: its saving is 8 pages' recompute


def _scheduler(lm_server):
    lm_server.wait_ready()
    sched = make_scheduler(
        host_blocks=16, remote_url=lm_server.url, remote_timeout_s=REMOTE_TIMEOUT_S, load_split=True
    )
    split = kvbm(sched).split
    # Two prefills that took SECONDS_PER_TOKEN a token (as if measured).
    split.prefill_done(0, 512, 512 * SECONDS_PER_TOKEN)
    split.prefill_done(0, 256, 256 * SECONDS_PER_TOKEN)
    # No model runs here: the harness's prefills, a step each, say nothing
    # of what recomputing costs, so the model stays as taught.
    split.prefill_done = lambda *a: None
    return sched


def _saving() -> float:
    return PAGES * BLOCK * SECONDS_PER_TOKEN


def _step_until_admitted(sched, reqs, timeout: float) -> dict[str, float]:
    """Steps until every request in ``reqs`` left the waiting queue; when each did."""
    left, deadline = {}, time.monotonic() + timeout
    while len(left) < len(reqs):
        assert time.monotonic() < deadline, "a request waited for the frozen server"
        step(sched, complete=True)
        for r in reqs:
            if r.request_id not in left and r.status != RequestStatus.WAITING:
                left[r.request_id] = time.monotonic()
        time.sleep(0.005)
    return left


def test_a_request_waits_about_its_saving_not_the_remote_timeout(lm_server):
    sched = _scheduler(lm_server)
    k = kvbm(sched)
    assert k.split.wait_bound(0, PAGES) == pytest.approx(_saving())
    lm_server.freeze()
    try:
        req = make_request(tokens(PAGES * BLOCK + 1, 71), max_tokens=2)
        added = time.monotonic()
        sched.add_request(req)
        step(sched, complete=True)
        assert req.status == RequestStatus.WAITING  # its answer is still out
        left = _step_until_admitted(sched, [req], timeout=REMOTE_TIMEOUT_S / 3)
        waited = left[req.request_id] - added
        assert waited >= _saving()  # never before the wait bound
        # it went on with what was known: nothing from the lower tiers
        assert k.stats.total["matched_tokens"] == 0
    finally:
        lm_server.thaw()


def test_requests_held_by_one_frozen_server_leave_at_their_own_times(lm_server):
    sched = _scheduler(lm_server)
    lm_server.freeze()
    try:
        first = make_request(tokens(PAGES * BLOCK + 1, 72), max_tokens=2)
        second = make_request(tokens(PAGES * BLOCK + 1, 73), max_tokens=2)
        sched.add_request(first)
        step(sched, complete=True)
        time.sleep(_saving() / 2)
        sched.add_request(second)
        left = _step_until_admitted(sched, [first], timeout=REMOTE_TIMEOUT_S / 3)
        assert second.status == RequestStatus.WAITING  # its own wait is not over
        left.update(_step_until_admitted(sched, [second], timeout=REMOTE_TIMEOUT_S / 3))
        assert left[second.request_id] - left[first.request_id] >= _saving() / 4
    finally:
        lm_server.thaw()


def test_an_answer_after_its_request_went_on_serves_the_next_request(lm_server):
    sched = _scheduler(lm_server)
    k = kvbm(sched)
    prompt = tokens(PAGES * BLOCK + 1, 74)
    keys = keys_of(sched, prompt)
    store = RemoteStore(
        lm_server.url, k.info.page_bytes, k.info.tier_namespace, 0, 1, timeout_s=5.0
    )
    try:
        put_where_the_scheduler_sees(store, k, keys, tier="remote")
    finally:
        store.close()
    lm_server.freeze()
    try:
        # Asked as vLLM asks a waiting request, each step, until it goes on
        # (not admitted here: computing it would store it in the host tier).
        found = lookup(k, make_request(prompt, max_tokens=2), timeout=REMOTE_TIMEOUT_S / 3)
        assert found == (0, False)  # went on with what was known: nothing
    finally:
        lm_server.thaw()
    deadline = time.monotonic() + 10
    while not k._background._late:  # the late answer lands
        assert time.monotonic() < deadline, "the late answer never came"
        time.sleep(0.01)
    again = make_request(prompt, max_tokens=2)
    # answered at the first ask: the whole prompt but the last token, from the server
    assert k.get_num_new_matched_tokens(again, 0) == (PAGES * BLOCK, True)
    assert k._reqs[again.request_id].lookup.hit_sources == ["remote"] * PAGES


def test_an_overdue_answer_holds_a_request_only_a_share_of_its_saving(lm_server):
    """Healthy lookups teach the lookup thread how long a call to the server
    takes; with the server then frozen its call is stuck within milliseconds,
    and the request goes on after OVERDUE_WAIT_SHARE of its saving, not all
    of it."""
    from vllm_kvbm.scheduler.prefix_lookup import OVERDUE_WAIT_SHARE

    sched = _scheduler(lm_server)
    k = kvbm(sched)
    for seed in range(80, 85):  # healthy answers (misses), each timed
        lookup(
            k,
            make_request(tokens(PAGES * BLOCK + 1, seed), max_tokens=2),
            timeout=REMOTE_TIMEOUT_S / 3,
        )
    assert k.lower.calls.samples >= 5
    lm_server.freeze()
    try:
        req = make_request(tokens(PAGES * BLOCK + 1, 79), max_tokens=2)
        added = time.monotonic()
        sched.add_request(req)
        left = _step_until_admitted(sched, [req], timeout=REMOTE_TIMEOUT_S / 3)
        waited = left[req.request_id] - added
        assert waited >= OVERDUE_WAIT_SHARE * _saving()
        assert waited < _saving() / 2  # not the whole saving
        assert k.stats.total["matched_tokens"] == 0
    finally:
        lm_server.thaw()
