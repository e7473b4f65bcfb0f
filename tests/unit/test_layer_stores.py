"""A step's stores copied layer by layer as vLLM reports each layer written
(worker/layer_copies.py), on real KV layouts and real threads.

Every byte of a store lands where the whole-block copy puts it, whichever
layers vLLM reports and in whatever order (those it does not report are
copied at ``wait_for_save``); nothing else is written; jobs the worker
would refuse are not copied; the caller waits for one copy at most however
busy the copy thread is; models whose layers view shared memory keep
whole-block stores; and through the worker, a layer-copied store is reported
in the step that computed it, its bytes copied before ``wait_for_save``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from test_page_mover import NB, make_layout, make_pool, movers  # noqa: F401 (fixture)
from test_worker_unit import engine_info
from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob
from vllm_kvbm.worker import layer_copies
from vllm_kvbm.worker import worker as worker_module
from vllm_kvbm.worker.host_copies import HostCopies
from vllm_kvbm.worker.kv_regions import block_regions
from vllm_kvbm.worker.layer_copies import LayerCopies, layer_tables
from vllm_kvbm.worker.worker import KVBMWorker


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


def stores(lay, pool, movers) -> LayerCopies:
    """Layer copies over ``lay`` and ``pool``, their thread on this process's first CPU."""
    mover = HostCopies(lay.caches, NB, pool, threads=1)
    movers.append(mover)
    tables = layer_tables(lay.caches, NB, None, mover.regions)
    assert tables is not None and set(tables) == set(lay.caches)
    return LayerCopies(tables, mover, {min(os.sched_getaffinity(0))})


def stuck_copy_thread(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(stuck, entered): the copy thread's first copy waits in it (``entered``
    set) until ``stuck`` is set, as a thread whose core is taken."""
    stuck, entered = threading.Event(), threading.Event()
    real = layer_copies._memmove

    def memmove(dst, src, n):
        if threading.current_thread().name == "kvbm-layer-copy" and not stuck.is_set():
            entered.set()
            assert stuck.wait(10)
        return real(dst, src, n)

    monkeypatch.setattr(layer_copies, "_memmove", memmove)
    return stuck, entered


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
def test_layers_copied_in_any_order_land_as_whole_block_copies(kind, gen, movers):
    lay = make_layout(kind, gen)
    pool = make_pool(12, lay.block_bytes(), gen)
    ls = stores(lay, pool, movers)
    jobs = [TransferJob(1, "A", [1, 2, 3], [7, 0, 3]), TransferJob(2, "B", [17, 30], [11, 4])]
    meta = KVBMConnectorMetadata(stores=jobs)
    before = pool.clone()
    names = list(lay.caches)
    for name in reversed(names[1:]):  # the first layer never reported: copied at finish
        ls.layer_saved(name, meta, lambda m: m.stores)
        ls.layer_saved(name, meta, lambda m: m.stores)  # twice: copied once
    step = ls.finish(meta)
    assert step is not None and step.wait(10) and step.poll() == "DONE"
    assert step.layers == set(names)
    for b, s in zip([1, 2, 3, 17, 30], [7, 0, 3, 11, 4]):
        assert torch.equal(pool[s], lay.slot_bytes(b))
    for s in set(range(12)) - {7, 0, 3, 11, 4}:
        assert torch.equal(pool[s], before[s])
    ls.close()


def test_only_the_jobs_the_worker_would_copy_are_copied(gen, movers):
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    ls = stores(lay, pool, movers)
    kept, refused = TransferJob(1, "A", [5], [1]), TransferJob(2, "B", [6], [2])
    wild = TransferJob(3, "C", [NB + 3], [3])  # out of range: left to the whole-block path
    meta = KVBMConnectorMetadata(stores=[kept, refused, wild])
    before = pool.clone()
    for name in lay.caches:
        ls.layer_saved(name, meta, lambda m: [kept, wild])
    step = ls.finish(meta)
    assert step.wait(10) and step.job_ids == {id(kept)}
    assert torch.equal(pool[1], lay.slot_bytes(5))
    assert torch.equal(pool[2], before[2]) and torch.equal(pool[3], before[3])
    # a step whose first layer finds nothing to store plans nothing
    empty = KVBMConnectorMetadata(stores=[refused])
    ls.layer_saved(next(iter(lay.caches)), empty, lambda m: [])
    assert ls.finish(empty) is None
    # wait_for_save of other metadata than the layers': nothing of theirs is reported
    ls.layer_saved(next(iter(lay.caches)), meta, lambda m: [kept])
    assert ls.finish(KVBMConnectorMetadata(stores=[kept])) is None
    ls.close()


def test_the_caller_waits_for_one_copy_at_most(gen, movers, monkeypatch):
    """A copy thread whose core is taken: wait_for_save copies what it has
    not started itself, and waits only for the copy it is in."""
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    ls = stores(lay, pool, movers)
    stuck, entered = stuck_copy_thread(monkeypatch)
    meta = KVBMConnectorMetadata(stores=[TransferJob(1, "A", [4, 9], [0, 5])])
    for name in lay.caches:
        ls.layer_saved(name, meta, lambda m: m.stores)
    assert entered.wait(10)
    step = ls.finish(meta)  # copies every other layer on this thread
    assert step.left == 1 and not step.wait(0.05) and step.poll() == "PROC"
    stuck.set()
    assert step.wait(10) and step.poll() == "DONE"
    assert torch.equal(pool[0], lay.slot_bytes(4)) and torch.equal(pool[5], lay.slot_bytes(9))
    ls.close()


def test_layers_viewing_shared_memory_keep_whole_block_stores(gen):
    lay = make_layout("cpu", gen)
    first = next(iter(lay.caches.values()))
    shared = {"a": first, "b": first}  # vLLM's hybrid allocator: two groups' layers, one tensor
    assert layer_tables(shared, NB, None, block_regions(shared, NB)) is None


def test_a_worker_reports_layer_copied_stores_in_their_step(gen, monkeypatch):
    monkeypatch.setattr(worker_module, "spare_cpus", lambda: {0})
    lay = make_layout("cpu", gen)
    worker = KVBMWorker(engine_info(lay), 8, "UCX", "kvbm-layer-test", host_copy_path="threads")
    worker.register_kv_caches(lay.caches, NB)
    try:
        assert worker.copies_by_layer
        job = TransferJob(1, "A", [3, 4], [2, 6])
        meta = KVBMConnectorMetadata(stores=[job])
        worker.start_loads(meta)  # start_load_kv
        for name in lay.caches:  # the forward pass, layer by layer
            worker.save_layer(name, meta)
        step = worker._layer_copies._step
        deadline = time.monotonic() + 10
        while step.left:  # the copy thread copies while the "forward pass" runs
            assert time.monotonic() < deadline
            time.sleep(0.001)
        worker.start_stores(meta)  # wait_for_save
        worker.get_finished(set())
        reported = worker.build_worker_meta()
        assert isinstance(reported, KVBMWorkerMetadata) and reported.stores_done[1] == 1
        assert reported.bytes_stored == 2 * lay.block_bytes()
        assert torch.equal(worker.host_pool[2], lay.slot_bytes(3))
        assert torch.equal(worker.host_pool[6], lay.slot_bytes(4))
    finally:
        worker.shutdown()
