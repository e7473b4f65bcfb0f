"""Scheduler side of the lower tiers, on vLLM's real Scheduler and real files.

The test plays the worker: pages are written with the worker's real
DiskStore into the directory the scheduler's DiskView reads.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from vllm.v1.request import RequestStatus

from helpers.tier_pages import disk_store_for, put_where_the_scheduler_sees, tier_of
from helpers.scheduler_harness import (
    BLOCK,
    admit,
    block_ids,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    step,
)
from helpers.scheduler_harness import keys_of, run_until_done, tokens
from vllm_kvbm.metrics import KVBMStats
from vllm_kvbm.scheduler.lookups import BackgroundLookups
from vllm_kvbm.scheduler.tier_policy import LowerTiers
from vllm_kvbm.tiers.base import TierView


class _Listed(TierView):
    """A tier view over an explicit key set (the policy, not a store, is tested)."""

    def __init__(self, name, keys=()):
        self.name, self.keys = name, set(keys)

    def contains(self, key):
        return key in self.keys


def test_lookup_order_is_disk_then_remote():
    tiers = LowerTiers([_Listed("disk", {b"a"}), _Listed("remote", {b"a", b"b"})])
    assert tier_of(tiers, b"a") == "disk"
    assert tier_of(tiers, b"b") == "remote"
    assert tier_of(tiers, b"c") is None


def admitted(tiers: LowerTiers, key: bytes, reused: bool) -> list[str]:
    """The tiers ``tiers.admit`` writes one key to."""
    runs = tiers.admit([key], reused)
    return runs[0][0] if runs else []


def test_admit_keeps_key_order_in_runs_of_the_same_tiers():
    tiers = LowerTiers([_Listed("disk"), _Listed("remote")], "frequency", disk_min_uses=2)
    tiers.admit([b"b"], reused=False)  # on the remote; the disk takes it next time
    assert tiers.admit([b"a", b"b", b"c", b"d", b"a"], reused=True) == [
        (["remote"], [b"a"]),
        (["disk"], [b"b"]),
        (["remote"], [b"c", b"d"]),
        (["disk"], [b"a"]),
    ]


def test_admission_always_writes_each_tier_once():
    disk, remote = _Listed("disk"), _Listed("remote")
    tiers = LowerTiers([disk, remote], "always")
    assert admitted(tiers, b"k", reused=False) == ["disk", "remote"]
    disk.keys.add(b"k")
    remote.keys.add(b"k")  # the worker's writes landed
    assert admitted(tiers, b"k", reused=True) == []  # written already
    disk.keys.discard(b"k")  # found corrupt: the worker removed it...
    tiers.forget("disk", b"k")  # ...and says so: it may be written again
    assert admitted(tiers, b"k", reused=True) == ["disk"]


def test_frequency_admission_waits_for_the_second_use():
    tiers = LowerTiers([_Listed("disk"), _Listed("remote")], "frequency", disk_min_uses=2)
    assert admitted(tiers, b"k", reused=False) == ["remote"]  # first use: no disk write
    assert admitted(tiers, b"k", reused=True) == ["disk"]  # used again: now the disk


def test_worker_events_become_counters():
    stats = KVBMStats()
    LowerTiers([]).record(
        Counter(
            {
                ("disk", "stored", 0): 3,
                ("remote", "stored", 0): 2,
                ("disk", "corrupt", 0): 1,
                ("remote", "error", 0): 4,
                ("disk", "miss", 0): 1,
                ("remote", "refused", 0): 5,
                ("disk", "ok", 0): 9,
            }
        ),
        stats,
    )
    assert stats.total == Counter(
        offload_blocks_h2d=3,
        offload_blocks_remote=2,
        checksum_failures=1,
        tier_read_errors=4,
        tier_read_misses=1,
        tier_write_errors=5,
    )


def test_a_page_counts_once_across_ranks_and_writes_count_pages():
    """TP=2: each rank writes or reads its shard of a page and reports it. A
    page is stored once both ranks stored it, failed once either failed;
    writes count pages, as the failures beside them do (not blocks: with
    4-block pages, 4 blocks written against 1 page failed)."""
    stats, tiers = KVBMStats(), LowerTiers([])
    tiers.record(
        Counter({("disk", "stored", 0): 2, ("disk", "stored", 1): 1, ("disk", "corrupt", 1): 1}),
        stats,
        2,
    )
    assert stats.total == Counter(offload_blocks_h2d=1, checksum_failures=1)
    tiers.record(
        Counter({("disk", "stored", 1): 1, ("disk", "corrupt", 0): 1, ("remote", "refused", 0): 1}),
        stats,
        2,
    )
    # rank 0's corrupt page is the one rank 1 found corrupt: still one failure
    assert stats.total == Counter(offload_blocks_h2d=2, checksum_failures=1, tier_write_errors=1)


@pytest.fixture
def disk_setup(tmp_path):
    sched = make_scheduler(host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    store = disk_store_for(k, tmp_path)
    yield sched, k, store
    store.close()


def test_disk_pages_are_found_loaded_through_host_slots_and_promoted(disk_setup):
    sched, k, store = disk_setup
    prompt = tokens(3 * BLOCK + 5, 11)
    keys = keys_of(sched, prompt)
    put_where_the_scheduler_sees(store, k, keys[:2])  # two of the three blocks on disk

    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    [load] = meta.loads
    assert load.block_ids == block_ids(sched, req.request_id)[:2]
    assert [(i, tier) for i, tier, _ in load.fetch] == [(0, "disk"), (1, "disk")]
    assert [key for _, _, key in load.fetch] == keys[:2]
    assert len(set(load.slots)) == 2 and min(load.slots) >= 0
    assert k.stats.total["matched_tokens_disk"] == 2 * BLOCK
    # Promoted slots are reserved, not yet visible to other lookups.
    assert not any(k.host.is_ready(key) for key in keys[:2])

    step(sched, finished_recving=[req.request_id])
    assert all(k.host.is_ready(key) for key in keys[:2])  # promoted into the host tier
    assert k.stats.total["onboard_blocks_d2d"] == 2
    assert k.stats.total["onboard_blocks_h2d"] == 2
    run_until_done(sched, req.request_id)


def test_a_failed_disk_load_drops_its_slots_and_the_request_recomputes(disk_setup):
    """The promoted slots of a failed load are freed. The pages stay on disk
    (an I/O error, not damage) and the failed block was the request's first,
    so vLLM looks the request up again: it must recompute, not load the same
    pages again (a tier that keeps failing sent a request round load, fail,
    look up thousands of times)."""
    sched, k, store = disk_setup
    prompt = tokens(2 * BLOCK + 1, 12)
    keys = keys_of(sched, prompt)
    put_where_the_scheduler_sees(store, k, keys[:2])
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    [load] = meta.loads
    step(
        sched,
        finished_recving=[req.request_id],
        loads_failed=[req.request_id],
        invalid_block_ids=load.block_ids,
    )
    assert not any(key in k.host for key in keys[:2])  # the reserved slots are free again
    assert k.stats.total["load_error_blocks"] == 2
    assert all(store.contains(key) for key in keys[:2])  # still listed by the tier
    computed = 0
    deadline = time.monotonic() + 30
    while req.request_id in sched.requests:  # a worker that completes everything
        assert time.monotonic() < deadline, f"{req.request_id} never finished"
        out, meta, _ = step(sched, complete=True)
        assert not [j for j in meta.loads if j.req_id == req.request_id], "loaded again"
        computed += out.num_scheduled_tokens.get(req.request_id, 0)
        time.sleep(0.002)
    assert computed >= len(prompt)  # the whole prompt computed, then a token


def test_stored_blocks_are_written_down_with_the_slot_pinned(disk_setup):
    sched, k, _ = disk_setup
    prompt = tokens(2 * BLOCK + 3, 13)
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    [job] = meta.stores
    _, meta, _ = step(sched, stores_done=[job.job_id])
    keys = keys_of(sched, prompt)
    _, meta, _ = step(sched)
    [spill] = meta.spills  # one job for the store's blocks
    assert spill.keys == keys and spill.tiers == ["disk"]
    assert spill.slots == [k.host._entries[key].slot for key in keys]
    assert all(k.host._entries[key].pins == 1 for key in keys)  # copy not done yet
    step(sched, spills_done=[spill.job_id])  # the worker copied them
    assert all(k.host._entries[key].pins == 0 for key in keys)
    run_until_done(sched, req.request_id)


def test_a_request_whose_prefix_is_being_promoted_waits_for_it(disk_setup):
    """Two requests share a prefix on disk: the second arrives while the
    first promotes it into the host tier. It waits (None) and then loads it
    from the host tier, instead of recomputing it."""
    sched, k, store = disk_setup
    prompt = tokens(3 * BLOCK + 5, 14)
    keys = keys_of(sched, prompt)
    put_where_the_scheduler_sees(store, k, keys[:3])
    first = make_request(prompt, max_tokens=2)
    sched.add_request(first)
    _, meta, _ = admit(sched, first)
    [load] = meta.loads
    assert [tier for _, tier, _ in load.fetch] == ["disk"] * 3
    second = make_request(prompt + [5, 6, 7], max_tokens=2)
    sched.add_request(second)
    out, meta, _ = step(sched)  # the promotion is still in flight
    assert second.request_id not in out.num_scheduled_tokens and not meta.loads
    assert second.status == RequestStatus.WAITING
    step(sched, finished_recving=[first.request_id])  # promoted into the host tier
    out, meta, _ = admit(sched, second)  # the disk is asked about the blocks after it
    # The loaded blocks are vLLM's own cached blocks now: the second request
    # computes only its tail, nothing of the shared prefix.
    assert out.num_scheduled_tokens[second.request_id] == len(second.prompt_token_ids) - 3 * BLOCK
    assert all(k.host.is_ready(key) for key in keys[:3])


class _Counted(_Listed):
    """A tier view that answers many keys per call, and counts the calls."""

    def __init__(self, name, keys=()):
        super().__init__(name, keys)
        self.calls = 0

    def contains_many(self, keys):
        self.calls += 1
        return [key in self.keys for key in keys]


def test_find_run_asks_each_tier_once_and_stops_at_the_first_gap():
    disk = _Listed("disk", {b"a", b"c"})
    remote = _Counted("remote", {b"b", b"c", b"e"})
    tiers = LowerTiers([disk, remote])
    assert tiers.find_run([b"a", b"b", b"c", b"d", b"e"]) == ["disk", "remote", "disk"]
    assert remote.calls == 1
    assert tiers.find_run([]) == [] and tier_of(tiers, b"b") == "remote"


def test_a_long_prefix_on_a_remote_tier_costs_a_few_round_trips():
    sched = make_scheduler(host_blocks=64)
    k = kvbm(sched)
    prompt = tokens(20 * BLOCK + 3, 15)
    keys = keys_of(sched, prompt)
    remote = _Counted("remote", keys[:20])
    k.lower = LowerTiers([remote])
    k._background = BackgroundLookups(k.lower)
    assert lookup(k, make_request(prompt)) == (20 * BLOCK, True)
    assert remote.calls == 5  # runs of 1, 2, 4, 8 and the last 5 blocks
    # A gap ends the hit where it is, whatever the batch.
    remote.keys.discard(keys[9])
    assert lookup(k, make_request(prompt)) == (9 * BLOCK, True)


def test_background_answers_serve_a_moving_start_and_are_refreshed(tmp_path, monkeypatch):
    """A real DiskView behind the lookup thread: one question per request, its
    answer serving while the lookup's start moves inside the run asked about;
    an old answer still serves while it is asked again, and the new one sees
    pages written since."""
    from vllm_kvbm.scheduler import lookups
    from vllm_kvbm.scheduler.lookups import BackgroundLookups
    from vllm_kvbm.tiers.disk.view import DiskView
    from vllm_kvbm.tiers.page_names import disk_page_path

    monkeypatch.setattr(lookups, "REFRESH_S", 0.2)
    keys = [bytes([i]) * 32 for i in range(8)]

    def write(key):
        open(disk_page_path(str(tmp_path), "ns", 4096, 0, 1, key), "wb").close()

    for key in keys[:3]:
        write(key)
    bg = BackgroundLookups(LowerTiers([DiskView(str(tmp_path), "ns", 4096, 1)]))

    def answer(start, timeout=5.0):
        deadline = time.monotonic() + timeout
        while (got := bg.ask("r", keys, start, len(keys))) is None:
            assert time.monotonic() < deadline, "never answered"
            time.sleep(0.01)
        run, offset = got
        return run[offset:]

    assert answer(0) == ["disk"] * 3
    assert bg._queue.qsize() == 0
    assert answer(1) == ["disk"] * 2  # the start moved: the same answer serves
    for key in keys[3:6]:
        write(key)
    assert answer(0) == ["disk"] * 3  # still fresh: not asked again
    time.sleep(0.3)
    assert answer(0) == ["disk"] * 3  # old: it serves while it is asked again...
    deadline = time.monotonic() + 5
    while answer(0) != ["disk"] * 6:  # ...and the new answer sees the new pages
        assert time.monotonic() < deadline, "the answer was never refreshed"
        time.sleep(0.05)
    bg.forget("r")
    assert bg.ask("r", keys, 0, len(keys)) is None  # forgotten: a new question
