"""Disk hits read layer by layer during the forward pass (worker/layer_reads.py,
tiers/disk/page_slices.py), on a real disk tier, real KV layouts and real threads.

A page read a layer's range at a time lands byte for byte as a whole read
puts it, checked as it goes (sealed pages too); a damaged one is "corrupt"
and removed. Through the worker: each layer's blocks hold the page's bytes
once vLLM's wait for it returns; a damaged page fails the step's loads (vLLM
recomputes them); reads that miss their deadline (a real FUSE mount whose
opens hang) fail the step without stalling it past the deadline, keep their slots from the host tier until
they end, and stop layered reads until then.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    BLOCK,
    admit,
    keys_of,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    step,
    store_and_finish,
    tokens,
    worker_output,
)
from helpers.tier_pages import put_on_disk_where_the_scheduler_sees
import test_layer_loads as layer_loads
from test_disk_reads import _drop_cached
from test_layer_loads import run_step, worker_with_layer_copies
from test_worker_unit import engine_info
from test_page_mover import NB, make_layout
from vllm_kvbm.messages import STREAM, KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.disk.store import DiskStore
from vllm_kvbm.scheduler import prefix_lookup
from vllm_kvbm.worker import layer_reads
from vllm_kvbm.worker.copy_runs import RegionTable
from vllm_kvbm.worker.layer_reads import layer_ranges


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(29)


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def page(n: int, gen) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def table(offsets: list[int], sizes: list[int], row: int) -> RegionTable:
    z = np.zeros(len(sizes), dtype=np.int64)
    return RegionTable(z, z + 1, np.array(sizes), np.array(offsets), row)


def test_layer_ranges_tile_the_row_in_layer_order_or_are_refused():
    tables = {"a": table([0, 8], [8, 8], 40), "b": table([24, 16], [16, 8], 40)}
    assert layer_ranges(tables) == {"a": (0, 16), "b": (16, 24)}
    swapped = {"b": tables["b"], "a": tables["a"]}  # layer order is not row order
    assert layer_ranges(swapped) is None
    gap = {"a": table([0, 10], [8, 8], 40), "b": table([18], [22], 40)}
    assert layer_ranges(gap) is None


@pytest.mark.parametrize("secret", [None, b"s" * 32])
def test_a_page_read_range_by_range_lands_as_a_whole_read_and_damage_is_caught(
    tmp_path, gen, secret
):
    size = 3 * 65536 + 96
    store = DiskStore(str(tmp_path), 16 << 20, size, "ns", 0, 1, page_secret=secret)
    try:
        pages = [page(size, gen) for _ in range(2)]
        for i, p in enumerate(pages):
            assert store.put(key(i), p)
        cuts = [0, 1000, 65536, 2 * 65536 + 5, size]
        out = torch.zeros(size, dtype=torch.uint8)
        slices = store.open_slices(key(0), out)
        slices.ahead(0, size)  # a hint: changes nothing read
        assert slices.start() is None
        for a, b in zip(cuts, cuts[1:]):
            slices.read(a, b - a)
        assert slices.finish() == "ok" and torch.equal(out, pages[0])
        assert store.open_slices(key(7), out) == "miss"
        # one byte flipped in the file: caught at the last range, removed
        path = store._disk._key_to_path(store._ckey(key(1)))
        with open(path, "r+b") as f:
            f.seek(96 + 70000)
            byte = f.read(1)
            f.seek(96 + 70000)
            f.write(bytes([byte[0] ^ 1]))
        slices = store.open_slices(key(1), out)
        assert slices.start() is None
        for a, b in zip(cuts, cuts[1:]):
            slices.read(a, b - a)
        assert slices.finish() == "corrupt" and not store.contains(key(1))
        # ranges not read, or read out of order, never pass
        store.put(key(2), pages[0])
        slices = store.open_slices(key(2), out)
        with pytest.raises(ValueError):
            slices.read(0, 1000)  # the header first
        assert slices.start() is None
        slices.read(0, 1000)
        with pytest.raises(ValueError):
            slices.read(5000, 10)
        assert slices.finish() == "corrupt"
    finally:
        store.close()


def test_a_truncated_page_or_a_damaged_header_is_corrupt_before_any_range(tmp_path, gen):
    size = 65536
    store = DiskStore(str(tmp_path), 16 << 20, size, "ns", 0, 1)
    try:
        for i in range(2):
            assert store.put(key(i), page(size, gen))
        out = torch.zeros(size, dtype=torch.uint8)
        truncated = store._disk._key_to_path(store._ckey(key(0)))
        os.truncate(truncated, 96 + size - 1)
        assert store.open_slices(key(0), out) == "corrupt" and not store.contains(key(0))
        damaged = store._disk._key_to_path(store._ckey(key(1)))
        with open(damaged, "r+b") as f:
            f.write(b"XXXX")  # the magic
        slices = store.open_slices(key(1), out)
        assert slices.start() == "corrupt" and not store.contains(key(1))
    finally:
        store.close()


def worker_with_disk(directory, lay, monkeypatch):
    worker = worker_with_layer_copies(lay, monkeypatch)
    store = DiskStore(str(directory), 64 << 20, lay.block_bytes(), "ns", 0, 1)
    worker.add_tier(store)
    first = worker.build_worker_meta()
    assert first is not None and first.layered_read_workers == 1
    return worker, store


def disk_pages(store, lay, gen, n: int) -> list[torch.Tensor]:
    """``n`` random pages put on ``store`` under key(0)..key(n-1)."""
    pages = [page(lay.block_bytes(), gen) for _ in range(n)]
    for i, p in enumerate(pages):
        assert store.put(key(i), p)
    return pages


@pytest.mark.parametrize("cold", [False, True])
def test_a_disk_hit_is_read_and_copied_layer_by_layer_in_its_step(tmp_path, gen, monkeypatch, cold):
    """``cold``: the page files evicted from the page cache first (read as
    the kernel reads them ahead)."""
    lay = make_layout("cpu", gen)
    worker, store = worker_with_disk(tmp_path, lay, monkeypatch)
    try:
        pages = disk_pages(store, lay, gen, 3)
        for i in range(3):
            if cold:
                _drop_cached(store._disk._key_to_path(store._ckey(key(i))))
        worker.host_pool[5].copy_(page(lay.block_bytes(), gen))  # a host hit beside them
        job = TransferJob(
            1, "A", [3, 4, 9, 11], [5, 0, 1, 2], layered=True,
            fetch=[(1, "disk", key(0)), (2, "disk", key(1)), (3, "disk", key(2))],
        )  # fmt: skip
        before = lay.clone_raw()
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        assert recving == set() and errors == set()
        assert meta.loads_done["A"] == 1 and not meta.loads_failed
        assert meta.tier_events[("disk", "ok", 0)] == 3 and not meta.bad_pages
        assert torch.equal(lay.slot_bytes(3), worker.host_pool[5])
        for block, slot, p in zip([4, 9, 11], [0, 1, 2], pages):
            assert torch.equal(lay.slot_bytes(block), p)
            assert torch.equal(worker.host_pool[slot], p)  # promoted: in the host tier now
        for b in set(range(NB)) - {3, 4, 9, 11}:
            assert torch.equal(lay.slot_bytes(b), lay.slot_bytes(b, before))
    finally:
        worker.shutdown()


def test_reads_past_their_deadline_fail_their_loads_and_hold_their_slots(
    mount, gen, monkeypatch, caplog
):
    """The disk's filesystem hangs (a FUSE mount whose opens block): the
    step's wait ends at the deadline, not with the hang; the step's host hit
    is loaded all the same. A page the late read then finds damaged is
    reported once it ends, so the scheduler forgets it."""
    monkeypatch.setattr(layer_reads, "READ_WAIT_MIN_S", 0.3)
    monkeypatch.setattr(layer_reads, "READS_BACK_AFTER_S", 0.0)
    lay = make_layout("cpu", gen)
    worker, store = worker_with_disk(mount.path, lay, monkeypatch)
    try:
        assert store.put(key(0), page(lay.block_bytes(), gen))
        assert store.put(key(1), page(lay.block_bytes(), gen))
        with open(store._disk._key_to_path(store._ckey(key(1))), "r+b") as f:
            f.write(b"XXXX")  # the magic: found "corrupt" as soon as it is opened
        worker.host_pool[5].copy_(page(lay.block_bytes(), gen))
        job = TransferJob(
            1, "A", [3, 8], [4, 2], layered=True, fetch=[(0, "disk", key(0)), (1, "disk", key(1))]
        )
        host = TransferJob(3, "C", [10], [5], layered=True)
        again = TransferJob(2, "B", [7], [6], layered=True, fetch=[(0, "disk", key(0))])
        before = lay.clone_raw()
        with mount.blocked():
            started = time.monotonic()
            loads = KVBMConnectorMetadata(loads=[job, host])
            recving, meta, errors = run_step(worker, loads, lay.caches)
            assert time.monotonic() - started < 10  # the deadline, not the hang
            assert errors == {3, 8} and dict(meta.loads_failed) == {"A": 1}
            assert meta.loads_done == {"A": 1, "C": 1}
            assert torch.equal(lay.slot_bytes(10), worker.host_pool[5])
            assert meta.slots_held == {4: 1, 2: 1} and meta.layered_read_workers == -1
            assert meta.tier_events[("disk", "error", 0)] == 2 and not meta.bad_pages
            [where] = [r.getMessage() for r in caplog.records if "at that moment" in r.getMessage()]
            assert "kvbm-layer-read in " in where and "file_io.py" in where, where
            # sent before the scheduler knew: failed unread
            loads = KVBMConnectorMetadata(loads=[again])
            _, meta, errors = run_step(worker, loads, lay.caches)
            assert errors == {7} and meta.loads_failed["B"] == 1 and not meta.slots_held
        bad: list = []
        assert released_and_back(worker, 4, bad) == (1, 1)  # slots free once the read ended
        assert bad == [("disk", key(1))]
        assert torch.equal(lay.slot_bytes(3), lay.slot_bytes(3, before))  # never written
    finally:
        worker.shutdown()


def released_and_back(
    worker, slot: int, bad: list | None = None, timeout: float = 30.0
) -> tuple[int, int]:
    """Steps the worker until it reported ``slot`` released and layered
    reads back (each once), or ``timeout``: (times released, net reads back);
    the bad pages reported meanwhile added to ``bad``."""
    deadline = time.monotonic() + timeout
    released = back = 0
    while (not released or not back) and time.monotonic() < deadline:
        worker.get_finished(set())
        meta = worker.build_worker_meta()
        if meta is not None:
            released += meta.slots_released[slot]
            back += meta.layered_read_workers
            if bad is not None:
                bad += meta.bad_pages
        time.sleep(0.01)
    return released, back


def scheduler_with_disk_pages(tmp_path, seed: int):
    """vLLM's real Scheduler with a 16-slot host tier and a disk tier whose
    pages hold a 3-block prompt (not in the host tier): (scheduler, the
    connector's scheduler side, the prompt, its page keys)."""
    sched = make_scheduler(host_blocks=16, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    prompt = tokens(3 * BLOCK + 5, seed)
    keys = keys_of(sched, prompt)
    put_on_disk_where_the_scheduler_sees(k, tmp_path, keys)
    return sched, k, prompt, keys


def test_a_disk_hit_is_synchronous_once_every_worker_reads_by_layer(tmp_path):
    """The scheduler's side: a hit with disk pages is returned to vLLM as
    synchronous (computed in the step that loads it, its disk pages promoted
    into host slots) only once every worker said it reads disk hits layer by
    layer; a promotion that finds no host slot fails unread (recomputed)."""
    sched, k, prompt, keys = scheduler_with_disk_pages(tmp_path, seed=64)
    step(sched, layered_workers=1)  # host hits by layer, disk hits not yet
    k.weights.reported([(k.weights.epoch, 0, "")])  # the worker's weights, as loaded
    assert lookup(k, make_request(prompt, max_tokens=2)) == (3 * BLOCK, True)
    step(sched, layered_read_workers=1)
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    out, meta, _ = admit(sched, req)
    (load,) = meta.loads
    assert load.layered and [tier for _, tier, _ in load.fetch] == ["disk"] * 3
    assert req.status == RequestStatus.RUNNING  # computed in this very step
    assert out.num_scheduled_tokens == {req.request_id: 5}
    assert not load.refuse and all(0 <= slot < 16 for slot in load.slots)
    step(sched, loads_done=[req.request_id])
    assert all(k.host.is_ready(key_) for key_ in keys)  # promoted: host hits from now on
    assert k.stats.total["onboard_layered_blocks"] == 3


def test_a_layered_disk_hit_without_a_host_slot_fails_unread(tmp_path):
    sched, k, prompt, keys = scheduler_with_disk_pages(tmp_path, seed=65)
    step(sched, layered_workers=1, layered_read_workers=1)
    k.weights.reported([(k.weights.epoch, 0, "")])
    req = make_request(prompt, max_tokens=2)
    assert lookup(k, req) == (3 * BLOCK, False)  # synchronous: a slot for each page now
    taken = [bytes([200 + i]) * 32 for i in range(15)]
    k.host.allocate_missing(taken, 0, 15)  # another request's stores take them meanwhile

    class Blocks:  # the blocks vLLM allocated the request
        def get_block_ids(self):
            return ([10, 11, 12, 13],)

    k.update_state_after_alloc(req, Blocks(), 3 * BLOCK)
    load = k._loads[-1]
    assert load.layered and load.refuse  # the worker fails it before any copy
    assert load.slots.count(STREAM) == 2  # one page got the last free slot


def test_pages_of_several_blocks_are_not_read_layer_by_layer(tmp_path, gen, monkeypatch):
    """Each layer of such a page lies in several ranges: read by layer, its
    bytes would not arrive in order for the checks, so they load before the step."""
    lay = make_layout("cpu", gen)
    monkeypatch.setattr(
        layer_loads, "engine_info", lambda lay: replace(engine_info(lay), page_blocks=2)
    )
    worker = worker_with_layer_copies(lay, monkeypatch)
    try:
        store = DiskStore(str(tmp_path), 64 << 20, 2 * lay.block_bytes(), "ns", 0, 1)
        worker.add_tier(store)
        meta = worker.build_worker_meta()
        assert meta.layered_workers == 1 and meta.layered_read_workers == 0
    finally:
        worker.shutdown()


def test_a_failed_layered_load_drops_the_stores_in_flight():
    """A layered load that failed computed its step on top of KV that may be
    bad: the pages stored from that step (reported done in the same step)
    never enter the host tier."""
    sched = make_scheduler()
    k = kvbm(sched)
    prompt = tokens(2 * BLOCK, 66)
    store_and_finish(sched, prompt)
    step(sched, layered_workers=1)
    assert sched.reset_prefix_cache()
    k.weights.reported([(k.weights.epoch, 0, "")])
    longer = prompt + tokens(2 * BLOCK + 5, 67)
    req = make_request(longer, max_tokens=2)
    sched.add_request(req)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    (load,) = meta.loads
    assert load.layered and meta.stores  # the step computes and stores two more pages
    new_keys = keys_of(sched, longer)[2:4]
    mro = worker_output(
        sched,
        out,
        loads_failed=[req.request_id],
        loads_done=[req.request_id],
        invalid_block_ids=load.block_ids,
        stores_done=[job.job_id for job in meta.stores],
    )
    sched.update_from_output(out, mro)
    assert not any(key_ in k.host for key_ in new_keys)


def test_a_disk_hit_over_the_layered_limit_loads_before_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(prefix_lookup, "LAYERED_READ_MAX_PAGES", 2)
    sched, k, prompt, _ = scheduler_with_disk_pages(tmp_path, seed=68)
    step(sched, layered_workers=1, layered_read_workers=1)
    k.weights.reported([(k.weights.epoch, 0, "")])
    assert lookup(k, make_request(prompt, max_tokens=2)) == (3 * BLOCK, True)


def test_the_layered_read_limit_counts_every_load_of_the_step(tmp_path, monkeypatch):
    """Two 3-page disk hits under a 4-page limit: the first admitted is read
    during the step, the second, in the same step, before it; the next step
    starts from nothing again."""
    monkeypatch.setattr(prefix_lookup, "LAYERED_READ_MAX_PAGES", 4)
    sched, k, prompt, _ = scheduler_with_disk_pages(tmp_path, seed=69)
    other = tokens(3 * BLOCK + 5, 70)
    put_on_disk_where_the_scheduler_sees(k, tmp_path, keys_of(sched, other))
    step(sched, layered_workers=1, layered_read_workers=1)
    k.weights.reported([(k.weights.epoch, 0, "")])
    first, second = make_request(prompt, max_tokens=2), make_request(other, max_tokens=2)
    assert lookup(k, first) == (3 * BLOCK, False)

    class Blocks:
        def get_block_ids(self):
            return ([10, 11, 12, 13],)

    k.update_state_after_alloc(first, Blocks(), 3 * BLOCK)
    assert k._loads[-1].layered and len(k._loads[-1].fetch) == 3
    assert lookup(k, second) == (3 * BLOCK, True)  # 6 pages this step: before it
    step(sched)  # the metadata sent: a new step
    assert lookup(k, second) == (3 * BLOCK, False)


def test_a_peer_hit_is_read_during_its_step_only_from_a_peer_read_lately(monkeypatch):
    """The workers' first contact with a peer (NIXL metadata, UCX's
    connection) can take longer than a step waits: a peer hit is layered
    only once a load from that peer succeeded within PEER_WARM_S."""
    sched = make_scheduler(host_blocks=16)
    k = kvbm(sched)
    now = [1000.0]
    monkeypatch.setattr(k.split, "clock", lambda: now[0])
    a, b = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"
    assert not k._peer_warm(a) and not k._peer_warm(None)
    k._peer_read(a)
    assert k._peer_warm(a) and not k._peer_warm(b)
    now[0] += prefix_lookup.PEER_WARM_S
    k._peer_read(b)
    assert not k._peer_warm(a) and a not in k._peers_read  # forgotten, not kept forever
    assert k._peer_warm(b)


def test_a_peer_hit_is_read_during_its_step_only_where_every_worker_reads_peers_in_place():
    """A worker whose peer tier could not register its host slots would
    fail every layered peer read (and drop the step's token): such hits
    load before the step until every worker said it reads peers in place."""
    sched = make_scheduler(host_blocks=16)
    k = kvbm(sched)
    a = "tcp://10.0.0.1:7000"
    k._peer_read(a)
    step(sched, layered_workers=1, layered_read_workers=1)
    assert k._peer_warm(a) and not k._peer_layered(a)
    step(sched, layered_peer_workers=1)
    assert k._peer_layered(a) and not k._peer_layered("tcp://10.0.0.2:7000")
