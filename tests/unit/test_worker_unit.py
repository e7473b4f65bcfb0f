"""KVBMWorker end to end on real tensors and real NIXL (UCX loopback, CPU)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch

from helpers.kv_layouts import KVLayout, agent_name, cpu_layout, flash_layout
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.engine_info import EngineInfo
from vllm_kvbm.keys import KeyNamespace
from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata, TransferJob
from vllm_kvbm.worker.worker import KVBMWorker
from vllm_kvbm.worker.streaming import staging_slots

# Flash layout, 16 layers x K/V x 256 B pages: a block is 8 KiB and a
# many-block job is thousands of NIXL descriptors, so it stays in flight for a
# few ms and the asynchronous paths are exercised. KV 2 MiB, host pool 1 MiB.
NB, SLOTS, LAYERS, BS = 256, 128, 16, 4


def engine_info(lay: KVLayout, block_size: int = BS) -> EngineInfo:
    bb = lay.block_bytes()
    ns = KeyNamespace(
        model="test-model@",
        dtype="torch.bfloat16",
        kv_layout="NHD",
        block_size=block_size,
        page_bytes=bb,
        tp_size=1,
    )
    return EngineInfo(
        block_size=block_size,
        block_bytes=bb,
        num_layers=lay.num_layers,
        num_workers=1,
        key_namespace=ns,
    )


class Harness:
    """A worker plus a running sum of its worker metadata, as vLLM aggregates it."""

    def __init__(self, lay: KVLayout, slots: int = SLOTS):
        self.lay = lay
        self.worker = KVBMWorker(engine_info(lay), slots, "UCX", agent_name("kvbm-worker"))
        self.worker.register_kv_caches(lay.caches, lay.num_blocks)
        self.meta = KVBMWorkerMetadata()
        self.sending: list[str] = []
        self.recving: list[str] = []

    @property
    def pool(self) -> torch.Tensor:
        return self.worker.host_pool

    def step(self) -> tuple[set[str], set[str]]:
        sending, recving = self.worker.get_finished(set())
        self.sending += sorted(sending)
        self.recving += sorted(recving)
        m = self.worker.build_worker_meta()
        if m is not None:
            self.meta = self.meta.aggregate(m)
        return sending, recving

    def step_until(self, cond, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "worker did not get there in time"
            self.step()
            time.sleep(0.0005)

    def pool_holds(self, blocks, slots) -> bool:
        return all(torch.equal(self.pool[s], self.lay.slot_bytes(b)) for b, s in zip(blocks, slots))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


@pytest.fixture
def harness(gen):
    made = []

    def make(kind: str = "flash", slots: int = SLOTS) -> Harness:
        if kind == "flash":
            lay = flash_layout(LAYERS, NB, block_size=BS, heads=2, head_dim=16, gen=gen)
        else:
            lay = cpu_layout(LAYERS, NB, heads=2, block_size=BS, head_size=16, gen=gen)
        h = Harness(lay, slots)
        made.append(h)
        return h

    yield make
    for h in made:
        h.worker.shutdown()


def split(gen, n_jobs: int, per_job: int):
    blocks = torch.randperm(NB, generator=gen)[: n_jobs * per_job].tolist()
    slots = torch.randperm(SLOTS, generator=gen)[: n_jobs * per_job].tolist()
    return [
        (blocks[i * per_job : (i + 1) * per_job], slots[i * per_job : (i + 1) * per_job])
        for i in range(n_jobs)
    ]


def test_register_allocates_pool_of_slots(harness):
    h = harness()
    # the host tier's slots, then the staging slots of streamed loads
    staging = h.worker._staging
    assert (staging.first, staging.count) == (SLOTS, staging_slots(h.lay.block_bytes()))
    assert h.pool.shape == (SLOTS + staging.count, h.lay.block_bytes())
    assert h.pool.dtype == torch.uint8
    assert h.worker.build_worker_meta() is None  # nothing happened yet
    assert h.worker.get_finished(set()) == (set(), set())


def test_register_rejects_block_bytes_mismatch(gen):
    lay = flash_layout(2, NB, block_size=BS, heads=2, head_dim=16, gen=gen)
    info = engine_info(lay)
    info = EngineInfo(
        info.block_size, info.block_bytes * 2, info.num_layers, info.num_workers, info.key_namespace
    )
    w = KVBMWorker(info, 4, "UCX", agent_name())
    with pytest.raises(KVBMConfigError, match="KV layout mismatch"):
        w.register_kv_caches(lay.caches, NB)


@pytest.mark.parametrize("kind", ["flash", "cpu"])
def test_store_then_load(kind, harness, gen):
    h = harness(kind)
    (b1, s1), (b2, s2) = split(gen, 2, 48)
    h.worker.start_stores(
        KVBMConnectorMetadata(stores=[TransferJob(11, "A", b1, s1), TransferJob(12, "B", b2, s2)])
    )
    h.step_until(lambda: sum(h.meta.stores_done.values()) == 2)
    assert h.meta.stores_done == Counter({11: 1, 12: 1})
    assert not h.meta.stores_failed
    assert h.meta.bytes_stored == 96 * h.lay.block_bytes()
    assert h.pool_holds(b1 + b2, s1 + s2)
    assert h.sending == [] and h.recving == []  # no delayed frees, no loads

    # load A's slots into blocks B's store read from (zeroed, as if reused)
    expected = [h.lay.slot_bytes(b) for b in b1]
    for b in b2:
        h.lay.zero_block(b)
    untouched = h.lay.clone_raw()
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(13, "R", b2, s1)]))
    h.step_until(lambda: "R" in h.recving)
    assert h.recving == ["R"]
    for b, exp in zip(b2, expected):
        assert torch.equal(h.lay.slot_bytes(b), exp)
    for b in set(range(NB)) - set(b2):
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(b, untouched)), b
    assert h.meta.bytes_loaded == 48 * h.lay.block_bytes()
    assert not h.meta.loads_failed
    assert h.worker.get_block_ids_with_load_errors() == set()
    # reported once only
    for _ in range(3):
        h.step()
    assert h.recving == ["R"] and h.sending == []


def test_failed_load_reports_recving_and_error_blocks(harness, gen):
    h = harness()
    (bs_, ss), (bl, _), (bbad, _) = split(gen, 3, 6)
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "S", bs_, ss)]))
    h.step_until(lambda: h.meta.stores_done[1] == 1)
    before = h.lay.clone_raw()
    h.worker.start_loads(
        KVBMConnectorMetadata(
            loads=[
                TransferJob(2, "X", bbad, ss[:5] + [h.pool.shape[0] + 3]),  # cannot start
                TransferJob(3, "Y", bl, ss),  # fine
            ]
        )
    )
    h.step_until(lambda: {"X", "Y"} <= set(h.recving))
    assert sorted(h.recving) == ["X", "Y"]
    assert h.worker.get_block_ids_with_load_errors() == set(bbad)
    assert h.worker.get_block_ids_with_load_errors() == set()  # drained
    assert h.meta.loads_failed == Counter({"X": 1})
    assert h.meta.bytes_loaded == 6 * h.lay.block_bytes()
    for b in bbad:  # the failed load wrote nothing
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(b, before))
    for b, src in zip(bl, bs_):
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(src))


def test_a_hybrid_models_failed_load_is_a_failed_request_not_block_ids(harness, gen):
    """vLLM takes no block ids from a model of several KV cache groups (they
    are unique per group only: it stops the engine); a failed load names the
    request instead (failed_recving), in the report that says it finished."""
    from vllm_kvbm.engine_info import GroupInfo

    h = harness()
    h.worker.info = dataclasses.replace(
        h.worker.info, groups=(GroupInfo(0, "full"), GroupInfo(1, "window", 8))
    )
    (bs_, ss), (bl, _), (bbad, _), (bref, _) = split(gen, 4, 6)
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "S", bs_, ss)]))
    h.step_until(lambda: h.meta.stores_done[1] == 1)
    before = h.lay.clone_raw()
    h.worker.start_loads(
        KVBMConnectorMetadata(
            loads=[
                TransferJob(2, "X", bbad, ss[:5] + [h.pool.shape[0] + 3]),  # cannot start
                TransferJob(3, "Y", bl, ss),  # fine
                TransferJob(4, "Z", bref, ss, refuse=True),  # refused by the scheduler
            ]
        )
    )
    failed: set[str] = set()
    while not {"X", "Y", "Z"} <= set(h.recving):
        _, recving = h.step()
        failed |= h.worker.take_failed_recving(recving)
        assert failed <= set(h.recving)  # never ahead of the finished report
    assert failed == {"X", "Z"}
    assert h.worker.get_block_ids_with_load_errors() == set()
    assert h.worker.take_failed_recving({"X", "Y", "Z"}) == set()  # reported once
    for b in bbad + bref:  # the failed loads wrote nothing
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(b, before))
    for b, src in zip(bl, bs_):
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(src))


def test_jobs_naming_other_lora_weights_than_loaded_are_refused(harness, gen, monkeypatch):
    """vLLM loaded adapter 5 from files whose fingerprint is "fp-a"; the
    scheduler keyed a request by "fp-b" (rewritten in between): its store is
    not cached and its load copies nothing (vLLM recomputes it)."""
    from vllm_kvbm.worker import lora_loads

    monkeypatch.setattr(lora_loads, "_loaded", {5: {"fp-a"}})
    h = harness()
    (b1, s1), (b2, s2), (b3, _) = split(gen, 3, 4)
    h.worker.start_stores(
        KVBMConnectorMetadata(
            stores=[
                TransferJob(1, "A", b1, s1, adapter=(5, "fp-a")),
                TransferJob(2, "B", b2, s2, adapter=(5, "fp-b")),
            ]
        )
    )
    h.step_until(lambda: h.meta.stores_done[1] == 1 and h.meta.stores_failed[2] == 1)
    assert not h.meta.stores_done[2]
    before = h.lay.clone_raw()
    h.worker.start_loads(
        KVBMConnectorMetadata(loads=[TransferJob(3, "C", b3, s1, adapter=(5, "fp-b"))])
    )
    h.step_until(lambda: "C" in h.recving)
    assert h.meta.loads_failed == Counter({"C": 1})
    assert h.worker.get_block_ids_with_load_errors() == set(b3)
    for b in b3:
        assert torch.equal(h.lay.slot_bytes(b), h.lay.slot_bytes(b, before))


def test_shutdown_waits_for_inflight_then_releases(harness, gen):
    h = harness()
    ((b, s),) = split(gen, 1, 120)
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(5, "Z", b, s)]))
    h.worker.shutdown()
    assert h.worker.mover is None
    assert h.pool_holds(b, s)  # the in-flight store finished before close
    h.worker.shutdown()  # idempotent
    # the same KV memory registers again with a fresh worker and moves bytes
    again = Harness(h.lay)
    try:
        again.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(6, "Z", b, s)]))
        again.step_until(lambda: again.meta.stores_done[6] == 1)
        assert again.pool_holds(b, s)
    finally:
        again.worker.shutdown()


# ---- transfers past their timeout ----------------------------------------------


class StuckNixl:
    """Makes the worker see its NIXL transfers as still running until ``end()``.

    A transfer stuck past its timeout cannot be produced for real here: UCX
    loopback finishes in milliseconds, and releasing a running transfer (the
    only way to cut one short) crashes UCX at close. The copies themselves are
    real; only their completion is reported late.
    """

    def __init__(self, worker: KVBMWorker, timeout_s: float = 0.05):
        worker.transfer_timeout_s = timeout_s
        self.timeout_s = timeout_s
        self.ended = False
        real = worker.mover.poll
        worker.mover.poll = lambda handle: real(handle) if self.ended else "PROC"

    def end(self) -> None:
        self.ended = True


def test_overdue_store_fails_and_holds_its_slots_until_it_ends(harness, gen):
    h = harness()
    stuck = StuckNixl(h.worker)
    ((b, s),) = split(gen, 1, 40)
    h.worker.start_stores(
        KVBMConnectorMetadata(stores=[TransferJob(1, "S", b, s)], delayed_free_req_ids=["S"])
    )
    h.step()
    assert h.sending == [] and not h.meta.stores_failed  # not overdue yet
    time.sleep(stuck.timeout_s)
    h.step_until(lambda: h.meta.stores_failed[1] == 1)
    # Failed, so its blocks are not cached and the request's blocks may be
    # freed; the host slots it may still write are held back.
    assert h.sending == ["S"]
    assert h.meta.transfer_timeouts == Counter(overdue=1) and not h.meta.stores_done
    assert h.meta.slots_held == Counter(s) and not h.meta.slots_released
    for _ in range(5):
        h.step()
    assert h.meta.transfer_timeouts == Counter(overdue=1)  # reported once
    assert not h.meta.slots_released
    stuck.end()
    h.step_until(lambda: h.meta.slots_released == Counter(s))
    assert h.meta.stores_failed == Counter({1: 1}) and not h.meta.stores_done
    assert h.meta.bytes_stored == 0
    assert not h.worker._inflight


def test_overdue_load_keeps_its_request_waiting_until_it_ends(harness, gen):
    h = harness()
    (bs_, ss), (bl, _) = split(gen, 2, 24)
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "S", bs_, ss)]))
    h.step_until(lambda: h.meta.stores_done[1] == 1)
    stuck = StuckNixl(h.worker)
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(2, "L", bl, ss)]))
    time.sleep(stuck.timeout_s)
    for _ in range(5):
        h.step()
    # Its engine blocks may still be written: never reported, never failed
    # (a recompute into them could be overwritten by the late copy).
    assert h.recving == [] and h.meta.transfer_timeouts == Counter(overdue=1)
    assert not h.meta.loads_failed and not h.worker.get_block_ids_with_load_errors()
    stuck.end()
    h.step_until(lambda: h.recving == ["L"])
    assert not h.meta.loads_failed and h.meta.bytes_loaded == 24 * h.lay.block_bytes()
    for dst, src in zip(bl, bs_):
        assert torch.equal(h.lay.slot_bytes(dst), h.lay.slot_bytes(src))


def test_preemption_flush_and_shutdown_are_bounded_by_the_timeout(harness, gen):
    h = harness()
    stuck = StuckNixl(h.worker, timeout_s=0.2)
    (bp, sp), (bl, sl) = split(gen, 2, 30)
    t = time.perf_counter()
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "P", bp, sp)]))
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(2, "L", bl, sl)]))
    h.worker.handle_preemptions(KVBMConnectorMetadata(flush_req_ids=["P"]))
    assert stuck.timeout_s <= time.perf_counter() - t < 5.0
    m = h.worker.build_worker_meta()
    assert m.stores_failed == Counter({1: 1}) and m.slots_held == Counter(sp)
    # Shutdown gives up on what is still running instead of hanging, and
    # leaves NIXL's registrations alone under the running copies.
    t = time.perf_counter()
    h.worker.shutdown()
    assert time.perf_counter() - t < 5.0
    assert h.worker.mover is None


# ---- stream order: a step's transfers wait for its fence (tests: test_worker_fences.py) ---


class ManualFence:
    """A step fence that is done when the test says so.

    On CUDA the fence is an event recorded on the engine's stream after the
    forward pass was launched; a pending event cannot be produced on CPU
    (the forward pass has finished when the connector is called), so this
    stands in for one. ``wait`` returns once it is done, as
    ``event.synchronize()`` does.
    """

    def __init__(self):
        self.is_done = False
        self.waits = 0

    def done(self) -> bool:
        return self.is_done

    def wait(self) -> None:
        self.waits += 1
        self.is_done = True


# ---- host pool ------------------------------------------------------------------


def test_host_pool_is_exactly_its_slots(harness):
    h = harness()
    # no power-of-two rounding: the storage is exactly the slots' bytes
    assert (
        h.pool.untyped_storage().nbytes() == (SLOTS + h.worker._staging.count) * h.lay.block_bytes()
    )
    assert not h.worker._host.pinned  # CPU KV: nothing to pin for DMA
