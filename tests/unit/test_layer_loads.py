"""Host-tier hits loaded layer by layer during the forward pass
(worker/layer_copies.py), on real KV layouts and real threads.

Each layer's blocks hold the host rows' bytes once vLLM's wait for that
layer returns, every byte lands where the whole-block load puts it and
nothing else is written; waiting for a layer copies on the caller the
earlier layers the copy thread has not started, and never waits for a later
one; through the worker, a layered load is reported in ``loads_done`` (never
as vLLM's finished_recving) in its own step, and a layer whose attention ran
without waiting fails the step's loads (their blocks are load errors, vLLM
recomputes them) and ends layered loads for that worker.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from test_page_mover import NB, make_layout, make_pool, movers  # noqa: F401 (fixture)
from test_layer_stores import stores, stuck_copy_thread
from test_worker_unit import engine_info
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker import layer_copies
from vllm_kvbm.worker import worker as worker_module
from vllm_kvbm.worker.host_copies import HostCopies
from vllm_kvbm.worker.layer_copies import LayerCopies, layer_tables
from vllm_kvbm.worker.worker import KVBMWorker


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(17)


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
def test_each_layer_is_loaded_when_its_wait_returns(kind, gen, movers):
    lay = make_layout(kind, gen)
    pool = make_pool(12, lay.block_bytes(), gen)
    lc = stores(lay, pool, movers)
    before = lay.clone_raw()
    blocks, slots = [5, 6, 20], [3, 9, 0]
    job = TransferJob(1, "A", blocks, slots, layered=True)
    assert lc.load([job]) == []
    [step] = lc._loads  # host hits only: one lane
    for name in lay.caches:
        lc.layer_needed(name)
        assert step.copied(name)
    [(ended, waited)] = lc.loads_ended()
    assert ended is step and waited and step.poll() == "DONE"
    for b, s in zip(blocks, slots):
        assert torch.equal(lay.slot_bytes(b), pool[s])
    for b in set(range(NB)) - set(blocks):
        assert torch.equal(lay.slot_bytes(b), lay.slot_bytes(b, before))
    assert lc.loads_ended() == []  # nothing left of the step
    lc.close()


def test_a_wait_copies_the_earlier_layers_itself_and_never_waits_for_later_ones(
    gen, movers, monkeypatch
):
    lay = make_layout("cpu", gen)  # 3 layers
    pool = make_pool(8, lay.block_bytes(), gen)
    lc = stores(lay, pool, movers)
    stuck, entered = stuck_copy_thread(monkeypatch)
    names = list(lay.caches)
    lc.load([TransferJob(1, "A", [4, 9], [0, 5], layered=True)])
    assert entered.wait(10)  # the thread is in layer 0's copy, stuck
    [step] = lc._loads
    lc.layer_needed(names[1])  # copied here, without waiting for layer 0
    assert [n for n in names if step.copied(n)] == [names[1]]
    stuck.set()
    for name in names:
        lc.layer_needed(name)
    [(step, waited)] = lc.loads_ended()
    assert waited and step.poll() == "DONE"
    assert torch.equal(lay.slot_bytes(4), pool[0]) and torch.equal(lay.slot_bytes(9), pool[5])
    lc.close()


def worker_with_layer_copies(lay, monkeypatch) -> KVBMWorker:
    monkeypatch.setattr(worker_module, "spare_cpus", lambda: {min(os.sched_getaffinity(0))})
    worker = KVBMWorker(engine_info(lay), 8, "UCX", "kvbm-layer-test", host_copy_path="threads")
    worker.register_kv_caches(lay.caches, NB)
    return worker


def run_step(worker, meta, layers) -> tuple[set[str], object, set[int]]:
    """start_load_kv, the forward pass waiting for ``layers``, wait_for_save
    and what vLLM collects after it."""
    worker.start_loads(meta)
    for name in layers:
        worker.wait_layer(name)
    worker.start_stores(meta)
    _, recving = worker.get_finished(set())
    return recving, worker.build_worker_meta(), worker.get_block_ids_with_load_errors()


def test_a_worker_reports_a_layered_load_in_its_step(gen, monkeypatch):
    lay = make_layout("cpu", gen)
    worker = worker_with_layer_copies(lay, monkeypatch)
    try:
        first = worker.build_worker_meta()
        assert first is not None and first.layered_workers == 1  # said once
        worker.host_pool[2].copy_(torch.randint(0, 255, (lay.block_bytes(),), dtype=torch.uint8))
        worker.host_pool[6].copy_(torch.randint(0, 255, (lay.block_bytes(),), dtype=torch.uint8))
        job = TransferJob(1, "A", [3, 4], [2, 6], layered=True)
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        assert recving == set() and errors == set()
        assert meta.loads_done["A"] == 1 and not meta.loads_failed
        assert 0 <= meta.layered_waits["A"] < 10  # what the forward pass waited
        assert meta.bytes_loaded == 2 * lay.block_bytes() and meta.layered_workers == 0
        assert torch.equal(lay.slot_bytes(3), worker.host_pool[2])
        assert torch.equal(lay.slot_bytes(4), worker.host_pool[6])
    finally:
        worker.shutdown()


def test_a_layer_not_waited_for_fails_the_loads_and_ends_layered_loads(gen, monkeypatch):
    lay = make_layout("cpu", gen)
    worker = worker_with_layer_copies(lay, monkeypatch)
    try:
        worker.build_worker_meta()
        names = list(lay.caches)
        job = TransferJob(1, "A", [3, 4], [2, 6], layered=True)
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), names[:-1])
        assert recving == set() and errors == {3, 4}  # vLLM recomputes them
        assert meta.loads_failed["A"] == 1 and meta.loads_done["A"] == 1
        assert meta.layered_workers == -1  # the scheduler stops asking
        # one the scheduler sent before it knew: failed before any copy
        again = TransferJob(2, "B", [7], [1], layered=True)
        before = lay.clone_raw()
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[again]), names)
        assert errors == {7} and meta.loads_done["B"] == 1 and meta.loads_failed["B"] == 1
        assert torch.equal(lay.slot_bytes(7), lay.slot_bytes(7, before))
    finally:
        worker.shutdown()


def test_layer_copies_end_with_the_step_even_without_any_wait(gen, monkeypatch):
    """A step whose forward pass never waited (no attention ran): its loads
    end before it is reported, none half-copied into blocks vLLM reuses."""
    lay = make_layout("cpu", gen)
    worker = worker_with_layer_copies(lay, monkeypatch)
    try:
        job = TransferJob(1, "A", [3], [2], layered=True)
        started = time.perf_counter()
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), [])
        assert errors == {3} and meta.loads_done["A"] == 1
        assert worker._layer_copies._loads == [] and time.perf_counter() - started < 10
    finally:
        worker.shutdown()
