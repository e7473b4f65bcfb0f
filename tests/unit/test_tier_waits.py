"""No wait on a tier without a deadline, and no tier I/O on vLLM's threads.

The disk tier lives on a FUSE mount whose metadata calls can be made to
block (helpers/blocking_fs.py): as a hung network filesystem, every stat and
open under it sleeps while blocked (30 s at most here). ``fsfreeze`` would
not do: it blocks writes, not ``stat``. Each test holds the mount blocked and
checks that vLLM's thread still gets through (a bound on a hang, far below
the 30 s a blocked call takes, not a speed figure), then that the work the
blocked call was for still happens once the mount answers again.
"""

from __future__ import annotations

import time

import torch

from helpers.scheduler_harness import (
    BLOCK,
    admit,
    keys_of,
    kvbm,
    make_request,
    make_scheduler,
    step,
    store_and_finish,
    tokens,
)
from helpers.tier_pages import disk_store_for, key, put_on_disk_where_the_scheduler_sees
from test_worker_unit import gen, harness  # noqa: F401 (fixtures)
from vllm_kvbm.messages import STREAM, KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.disk.store import DiskStore

# What a step may take while the mount is blocked: a blocked stat takes 30 s.
HANG_BOUND_S = 2.0


def test_the_mount_blocks_stat_while_blocked(mount):
    """The premise of the tests below: a blocked getattr blocks os.path.exists."""
    import threading

    (mount.path / "f").write_bytes(b"x")
    took = []
    with mount.blocked():
        t = threading.Thread(target=lambda: took.append(_timed(mount.path / "f")))
        t.start()
        t.join(HANG_BOUND_S)
        assert t.is_alive()  # still in stat
    t.join(10)
    assert took and took[0] >= HANG_BOUND_S


def _timed(path) -> float:
    import os

    start = time.monotonic()
    os.path.exists(path)
    return time.monotonic() - start


def _timed_step(sched, **report):
    start = time.monotonic()
    result = step(sched, **report)
    return time.monotonic() - start, result


def test_the_disk_check_after_a_load_runs_off_the_scheduler_thread(mount):
    """A prompt stored once (frequency admission: not on disk yet) is loaded
    from the host tier; the write-through then asks the disk whether it holds
    the reused pages. With the disk's filesystem hung, the step that reports
    the load done completes at once, and the pages are spilled once the disk
    answers."""
    sched = make_scheduler(
        host_blocks=16,
        disk_cache_dir=str(mount.path),
        disk_cache_size="64MiB",
        disk_admission="frequency",
    )
    k = kvbm(sched)
    prompt = tokens(3 * BLOCK + 5, 61)
    keys = keys_of(sched, prompt)
    _, metas = store_and_finish(sched, prompt)
    assert not [s for m in metas for s in m.spills]  # first use: not written down
    assert all(k.host.is_ready(key_) for key_ in keys)
    assert sched.reset_prefix_cache()  # vLLM forgets it; the host tier has it

    again = make_request(prompt, max_tokens=2)
    sched.add_request(again)
    _, meta, _ = admit(sched, again)
    [load] = meta.loads
    assert not load.fetch  # all from the host tier
    with mount.blocked():
        took, (_, meta, _) = _timed_step(sched, finished_recving=[again.request_id])
        assert took < HANG_BOUND_S, f"a step took {took:.1f}s on a hung disk"
        assert k.has_pending_work()  # the check is still out
        took, _ = _timed_step(sched)
        assert took < HANG_BOUND_S
    spills = []
    deadline = time.monotonic() + 40
    while not spills:
        assert time.monotonic() < deadline, "the reused pages were never spilled"
        _, meta, _ = step(sched)
        spills += meta.spills
        time.sleep(0.01)
    assert [key_ for s in spills for key_ in s.keys] == keys
    assert all(s.tiers == ["disk"] for s in spills)  # the second use: now the disk takes it


def test_the_disk_check_skips_pages_the_disk_has(mount):
    """What the check is for: reused pages already on disk are not written again."""
    sched = make_scheduler(
        host_blocks=16,
        disk_cache_dir=str(mount.path),
        disk_cache_size="64MiB",
        disk_admission="frequency",
    )
    k = kvbm(sched)
    prompt = tokens(3 * BLOCK + 5, 62)
    keys = keys_of(sched, prompt)
    store_and_finish(sched, prompt)
    put_on_disk_where_the_scheduler_sees(k, mount.path, keys[:2])
    assert sched.reset_prefix_cache()
    again = make_request(prompt, max_tokens=2)
    sched.add_request(again)
    admit(sched, again)
    step(sched, finished_recving=[again.request_id])
    spills = []
    deadline = time.monotonic() + 20
    while k.has_pending_work() or not spills:
        assert time.monotonic() < deadline, "the reused page was never spilled"
        _, meta, _ = step(sched)
        spills += meta.spills
        for s in meta.spills:
            step(sched, spills_done=[s.job_id])
        time.sleep(0.01)
    assert [key_ for s in spills for key_ in s.keys] == keys[2:]


def test_may_load_async_asks_the_lookup_thread(mount):
    """vLLM >= 0.34 asks may_load_async when a request is queued, on its
    scheduler thread: with the disk hung it answers at once (not known yet:
    False); once the disk answers, True, and the request's lookup uses that
    answer."""
    sched = make_scheduler(host_blocks=16, disk_cache_dir=str(mount.path), disk_cache_size="64MiB")
    k = kvbm(sched)
    prompt = tokens(3 * BLOCK + 5, 63)
    keys = keys_of(sched, prompt)
    put_on_disk_where_the_scheduler_sees(k, mount.path, keys)
    req = make_request(prompt, max_tokens=2)
    with mount.blocked():
        start = time.monotonic()
        guess = sched.connector.may_load_async(req)
        took = time.monotonic() - start
        assert took < HANG_BOUND_S, f"may_load_async took {took:.1f}s on a hung disk"
        assert guess is False  # not known yet
    deadline = time.monotonic() + 40
    while not sched.connector.may_load_async(req):
        assert time.monotonic() < deadline, "the lookup thread never answered"
        time.sleep(0.01)
    assert k.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)


def test_a_streamed_load_waiting_for_staging_slots_fails_at_its_deadline(mount, harness):
    """Load A streams many disk pages from a slow filesystem (each metadata
    call may block 0.3 s): it progresses, and each part that ends hands its
    staging slots to A's next part, so load B, queued after it, gets none.
    B fails once it has waited tier_read_timeout_s for slots (vLLM recomputes
    it) while A still streams, instead of waiting for the whole of A; A then
    completes intact."""
    h = harness()
    h.worker.tier_io.read_timeout_s = 2.0
    staging = h.worker._staging
    n = [40 * staging.count, staging.count]  # pages of A and of B
    bb = h.lay.block_bytes()
    # Written beside the mount (fast); the worker's store reads them through it.
    writer = DiskStore(str(mount.root), 64 << 20, bb, "ns", 0, 1)
    g = torch.Generator().manual_seed(5)
    pages = [torch.randint(0, 256, (bb,), dtype=torch.uint8, generator=g) for _ in range(sum(n))]
    for i, p in enumerate(pages):
        assert writer.put(key(i), p)
    writer.close()
    h.worker.add_tier(DiskStore(str(mount.path), 64 << 20, bb, "ns", 0, 1))
    first = [0, n[0]]
    jobs = [
        TransferJob(
            1 + j,
            f"R{j}",
            [b % 256 for b in range(first[j], first[j] + n[j])],
            [STREAM] * n[j],
            fetch=[(i, "disk", key(first[j] + i)) for i in range(n[j])],
        )
        for j in range(2)
    ]
    jobs[1].block_ids = list(range(256 - n[1], 256))
    jobs[0].block_ids = [b % (256 - n[1]) for b in range(n[0])]
    with mount.slow(blocked_s=0.3, open_s=0.05):
        h.worker.start_loads(KVBMConnectorMetadata(loads=jobs))
        assert staging.free == 0 and h.worker._streams_waiting  # R1 waits for slots
        h.step_until(lambda: "R1" in h.recving, timeout=5)
        assert h.meta.loads_failed == {"R1": 1}
        assert h.meta.transfer_timeouts == {"no_staging_slot": 1}
        assert "R0" not in h.recving  # still streaming
        assert h.worker.get_block_ids_with_load_errors() == set(jobs[1].block_ids)
    h.step_until(lambda: "R0" in h.recving, timeout=60)
    assert h.meta.loads_failed == {"R1": 1}  # R0 intact: each block holds its last page
    last = {b: i for i, b in enumerate(jobs[0].block_ids)}
    assert all(torch.equal(h.lay.slot_bytes(b), pages[i]) for b, i in last.items())
    assert staging.free == staging.count and not h.worker._streams_waiting


def test_a_lookup_held_by_a_hung_disk_is_overdue_and_so_are_those_behind_it(mount):
    """The lookup thread times its calls into the tiers: with the disk
    healthy a question is answered without ever being overdue; with the mount
    hung the question in stat and one queued behind it are overdue within a
    small multiple of a healthy call (not the 30 s the stat takes), and
    neither is once answered."""
    from vllm_kvbm.scheduler.lookups import BackgroundLookups
    from vllm_kvbm.scheduler.tier_policy import LowerTiers
    from vllm_kvbm.tiers.disk.view import DiskView

    lower = LowerTiers([DiskView(str(mount.path), "ns", 4096, 1)])
    bg = BackgroundLookups(lower)
    keys = [bytes([i]) * 32 for i in range(8)]

    def answered(req_id, timeout):
        deadline = time.monotonic() + timeout
        while bg.ask(req_id, keys, 0, len(keys)) is None:
            assert time.monotonic() < deadline, "never answered"
            time.sleep(0.005)

    assert not bg.overdue("healthy")  # never asked, nothing timed
    for i in range(5):
        answered(f"healthy{i}", 5.0)
        assert not bg.overdue(f"healthy{i}")
    usual = lower.calls.usual_max()
    assert usual is not None and usual < HANG_BOUND_S / 4
    with mount.blocked():
        assert bg.ask("first", keys, 0, len(keys)) is None
        assert bg.ask("behind", keys, 0, len(keys)) is None
        start = time.monotonic()
        while not (bg.overdue("first") and bg.overdue("behind")):
            assert time.monotonic() - start < HANG_BOUND_S, "never overdue"
            time.sleep(0.005)
    answered("first", 40.0)
    answered("behind", 5.0)
    assert not bg.overdue("first") and not bg.overdue("behind")
    assert not lower.calls.stuck()


def test_a_long_call_does_not_make_the_next_freeze_look_usual():
    """A call much longer than usual (a stat that waited out a hung mount)
    counts as the usual maximum: it barely moves it; a tier that stays slower
    raises it within tens of calls."""
    from vllm_kvbm.scheduler.tier_calls import TierCalls

    calls = TierCalls()
    for _ in range(20):
        calls.add(0.002)
    usual = calls.usual_max()
    calls.add(30.0)
    assert calls.usual_max() < 1.5 * usual
    for _ in range(60):
        calls.add(0.2)  # the tier is slower now, for good
    assert calls.usual_max() > 0.2


def test_a_failed_call_to_a_frozen_server_is_not_counted():
    """A server that accepts connections and never answers (a listening
    socket nobody reads: what the kernel does for a SIGSTOPped server): the
    view's call times out and the view is down; that call's time is not
    counted, so the next freeze is noticed as soon as the first."""
    import socket

    from vllm_kvbm.scheduler.tier_policy import LowerTiers
    from vllm_kvbm.tiers.lm.view import RemoteView

    frozen = socket.create_server(("127.0.0.1", 0))
    try:
        view = RemoteView(f"lm://127.0.0.1:{frozen.getsockname()[1]}", "ns", 4096, 1, timeout_s=0.3)
        lower = LowerTiers([view])
        lower.calls.add(0.001)
        usual = lower.calls.usual_max()
        assert lower.find_run([b"k" * 32]) == []  # timed out: a miss
        assert view.down
        assert lower.calls.samples == 1 and lower.calls.usual_max() == usual
        view.close()
    finally:
        frozen.close()
