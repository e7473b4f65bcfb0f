"""A layered step's loads fail one by one (worker/layer_copies.py,
worker/layered_steps.py), on a real disk tier, real KV layouts and real
threads: a page found bad after its last layer was copied fails only the
load of the request holding it, the step's host hits are a lane of their
own, and a wait for a layer whose copy is still running outlasts a failure
reported meanwhile (attention never reads a half-copied layer of a load
kept).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from test_layer_loads import run_step
from test_layer_reads import disk_pages, key, page, worker_with_disk
from test_layer_stores import stores, stuck_copy_thread
from test_page_mover import NB, make_layout, make_pool
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.worker.layer_reads import StepReads


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(29)


def _flip(store, k: bytes, at: int, mask: int) -> None:
    """Byte ``at`` of ``k``'s page file (negative: from its end) XORed with ``mask``."""
    path = store._disk._key_to_path(store._ckey(k))
    with open(path, "r+b") as f:
        f.seek(at if at >= 0 else os.path.getsize(path) + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


def test_a_damaged_disk_page_fails_only_its_own_requests_layered_load(tmp_path, gen, monkeypatch):
    """Found bad after its last layer was copied: the request holding it is
    recomputed; the step's other disk hit and its host hit keep their KV."""
    lay = make_layout("cpu", gen)
    worker, store = worker_with_disk(tmp_path, lay, monkeypatch)
    try:
        pages = disk_pages(store, lay, gen, 3)
        _flip(store, key(1), -1, 0x80)  # the last layer's last byte
        worker.host_pool[6].copy_(page(lay.block_bytes(), gen))
        a = TransferJob(
            1, "A", [3, 4], [0, 2], layered=True, fetch=[(0, "disk", key(0)), (1, "disk", key(2))]
        )
        b = TransferJob(2, "B", [7], [1], layered=True, fetch=[(0, "disk", key(1))])
        c = TransferJob(3, "C", [9], [6], layered=True)  # a host hit
        loads = KVBMConnectorMetadata(loads=[a, b, c])
        recving, meta, errors = run_step(worker, loads, lay.caches)
        assert errors == {7} and dict(meta.loads_failed) == {"B": 1}
        assert meta.loads_done == {"A": 1, "B": 1, "C": 1}
        assert meta.bad_pages == [("disk", key(1))] and not store.contains(key(1))
        assert meta.tier_events[("disk", "corrupt", 0)] == 1
        assert meta.tier_events[("disk", "ok", 0)] == 2
        assert meta.layered_read_workers == 0  # a bad page is no reason to stop
        assert torch.equal(lay.slot_bytes(3), pages[0]) and torch.equal(lay.slot_bytes(4), pages[2])
        assert torch.equal(lay.slot_bytes(9), worker.host_pool[6])
    finally:
        worker.shutdown()


def test_steps_of_host_hits_good_and_damaged_disk_pages_keep_exactly_the_good_loads(
    tmp_path, monkeypatch
):
    """Steps mixing host hits, disk hits and damaged disk pages (damaged in
    their first or last layer), drawn at random: every load reported good
    holds its pages' bytes in its blocks, every load holding a damaged page
    is reported failed with its blocks, and no other block is written."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(41)
    lay = make_layout("cpu", gen)
    worker, store = worker_with_disk(tmp_path, lay, monkeypatch)
    size = lay.block_bytes()
    try:
        for round_ in range(12):
            blocks = iter(rng.permutation(NB).tolist())
            slots = iter(rng.permutation(8).tolist())
            jobs, want, bad_jobs = [], {}, set()
            for j in range(int(rng.integers(1, 4))):
                kind = rng.choice(["host", "disk", "damaged"])
                n = int(rng.integers(1, 3))
                job_blocks, job_slots = (
                    [next(blocks) for _ in range(n)],
                    [next(slots) for _ in range(n)],
                )
                fetch = []
                for i, slot in enumerate(job_slots):
                    data = page(size, gen)
                    if kind == "host":
                        worker.host_pool[slot].copy_(data)
                    else:
                        k = bytes([round_ + 1, j, i + 1]) * 8 + bytes(8)
                        assert store.put(k, data)
                        fetch.append((i, "disk", k))
                        if kind == "damaged" and i == n - 1:
                            at = 0 if rng.random() < 0.5 else size - 1  # first or last layer
                            _flip(store, k, HEADER_BYTES + at, 0x10)
                    want[job_blocks[i]] = data
                req = f"R{round_}-{j}"
                if kind == "damaged":
                    bad_jobs.add(req)
                jobs.append(
                    TransferJob(
                        round_ * 10 + j, req, job_blocks, job_slots, layered=True, fetch=fetch
                    )
                )
            before = lay.clone_raw()
            _, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=jobs), lay.caches)
            assert set(meta.loads_failed) == bad_jobs, round_
            assert meta.loads_done == {job.req_id: 1 for job in jobs}
            assert errors == {b for job in jobs if job.req_id in bad_jobs for b in job.block_ids}
            for job in jobs:
                if job.req_id not in bad_jobs:
                    for b in job.block_ids:
                        assert torch.equal(lay.slot_bytes(b), want[b]), (round_, job.req_id)
            for b in set(range(NB)) - set(want):
                assert torch.equal(lay.slot_bytes(b), lay.slot_bytes(b, before))
    finally:
        worker.shutdown()


class _Reads:
    """The read thread's side (layer_reads.LayerReader), driven by the test:
    which layers are read (``post``) and when a page is found bad (``fail``)."""

    def plan(self, jobs):
        pages = [(job, "disk", k, job.slots[i]) for job in jobs for i, _, k in job.fetch]
        self.reads = StepReads(pages, time.perf_counter() + 30)
        return self.reads

    def start(self, reads, post, fail):
        self.post, self.fail = post, fail


@pytest.fixture
def lanes(monkeypatch):
    """Layer copies over a 3-layer CPU layout and an 8-slot pool, their copy
    thread stuck in its first copy until ``stuck`` is set (``entered`` once
    it is), and the reader the test drives: (lay, pool, lc, stuck, entered,
    reader, names)."""
    gen = torch.Generator().manual_seed(43)
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    movers: list = []
    lc = stores(lay, pool, movers)
    stuck, entered = stuck_copy_thread(monkeypatch)
    yield lay, pool, lc, stuck, entered, _Reads(), list(lay.caches)
    stuck.set()
    lc.close()
    for m in movers:
        m.close()


def test_a_wait_for_a_posted_layer_outlasts_a_failure_reported_meanwhile(lanes):
    """A page's bad verdict arrives while the copy of a layer already read
    is still running (its thread's core taken): the wait for that layer
    returns only once the copy ended, as the loads found good keep their
    KV; a layer never posted is not waited for."""
    _, _, lc, stuck, entered, reader, names = lanes
    job = TransferJob(1, "A", [4, 9], [0, 5], layered=True, fetch=[(0, "disk", key(0))])
    assert lc.load([job], reader) == []
    reader.post(names[0])
    assert entered.wait(10)  # the copy thread is in layer 0's copy
    returned = threading.Event()
    waiting = threading.Thread(
        target=lambda: (lc.layer_needed(names[0]), returned.set()), daemon=True
    )
    waiting.start()
    reader.fail()  # a page's verdict: bad
    assert not returned.wait(0.5)  # the copy still runs: so does the wait
    stuck.set()
    assert returned.wait(10)
    [step] = [lane for lane in lc._loads if lane.reads is not None]
    assert step.copied(names[0])
    started = time.monotonic()
    lc.layer_needed(names[1])  # never posted (the read failed): not waited for
    assert time.monotonic() - started < 5
    reader.reads.ended.set()
    [(ended, waited)] = lc.loads_ended()
    assert ended is step and waited and step.layers == {names[0]}


def test_a_layer_read_late_is_copied_before_the_host_hits_later_layers(lanes):
    """The host hits' copies are posted at once, a read's layer once read:
    that layer goes before the host hits' later layers, so the wait for it
    copies it itself rather than wait for the host lane's every layer behind
    a copy thread whose core is taken."""
    lay, pool, lc, stuck, entered, reader, names = lanes
    host = TransferJob(1, "H", [2, 3], [1, 2], layered=True)
    read = TransferJob(2, "R", [7], [6], layered=True, fetch=[(0, "disk", key(0))])
    assert lc.load([host, read], reader) == []
    assert entered.wait(10)  # the copy thread is stuck in the host hits' layer 0
    reader.post(names[0])
    waiting = threading.Thread(target=lambda: lc.layer_needed(names[0]), daemon=True)
    waiting.start()
    [lane] = [lane for lane in lc._loads if lane.reads is not None]
    deadline = time.monotonic() + 10
    while not lane.copied(names[0]):  # copied by the waiting thread
        assert time.monotonic() < deadline, "the read's layer waited behind the host lane"
        time.sleep(0.01)
    stuck.set()
    waiting.join(10)
    for name in names[1:]:
        reader.post(name)
    for name in names:
        lc.layer_needed(name)
    reader.reads.ended.set()
    ended = lc.loads_ended()
    assert [waited for _, waited in ended] == [True, True]
    assert torch.equal(lay.slot_bytes(7), pool[6]) and torch.equal(lay.slot_bytes(2), pool[1])
