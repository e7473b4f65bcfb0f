"""Requests held for the lower tiers' answer never prefill together when they
arrived apart.

vLLM's real Scheduler with KVBM and a real LMCache server, frozen (SIGSTOP):
every newcomer's lookup waits behind the one stuck call, while a running
request decodes. When the answer comes (here: the server thawed), vLLM would
admit every held newcomer in one step, and that step's prefills, one per
newcomer, stall the decoding request for all of them together; without the
connector each newcomer would have been prefilled in a step of its own as it
arrived. So held requests go on one arrival step's worth per step: those
that arrived together still go on together.
"""

from __future__ import annotations

import time

from helpers.scheduler_harness import BLOCK, admit, kvbm, make_request, make_scheduler, step, tokens

# Far above the test's length: the answers come when the server is thawed.
REMOTE_TIMEOUT_S = 60.0
STEPS_APART = 10  # steps between arrivals, as in the frozen-remote benchmark


def _answered(k, reqs) -> bool:
    bg = k._background
    with bg._lock:
        return all(bg._entries[r.request_id].run is not None for r in reqs)


def test_held_newcomers_go_on_one_arrival_step_per_step(lm_server):
    lm_server.wait_ready()
    sched = make_scheduler(
        host_blocks=16,
        remote_url=lm_server.url,
        remote_timeout_s=REMOTE_TIMEOUT_S,
        max_batched=1024,
    )
    k = kvbm(sched)
    decoder = make_request(tokens(BLOCK + 3, 90), max_tokens=500)
    sched.add_request(decoder)
    admit(sched, decoder, timeout=30, complete=True)
    # Arrivals: two together, then one every STEPS_APART steps.
    arrivals = [[91, 92], [93], [94], [95]]
    newcomers = {}
    lm_server.freeze()
    try:
        for group in arrivals:
            for seed in group:
                req = make_request(tokens(3 * BLOCK + 1, seed), max_tokens=2)
                newcomers[req.request_id] = seed
                sched.add_request(req)
            for _ in range(STEPS_APART):
                out, _, _ = step(sched, complete=True)
                assert decoder.request_id in out.num_scheduled_tokens  # it decodes
                assert not out.scheduled_new_reqs  # every newcomer is held
    finally:
        lm_server.thaw()
    held = [sched.requests[r] for r in newcomers]
    deadline = time.monotonic() + 30
    while not _answered(k, held):  # every answer is in before the next step
        assert time.monotonic() < deadline, "the thawed server never answered"
        time.sleep(0.01)
    admitted = []  # (step, newcomers admitted in it)
    for i in range(2 * len(arrivals)):
        out, _, _ = step(sched, complete=True)
        assert decoder.request_id in out.num_scheduled_tokens
        new = sorted(newcomers[r.req_id] for r in out.scheduled_new_reqs)
        if new:
            admitted.append((i, new))
    # One arrival step's newcomers per step, oldest first, in the steps
    # right after the answers came (none held longer than that).
    assert admitted == list(enumerate(arrivals))
