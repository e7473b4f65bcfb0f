"""KVBMWorker on real tensors and real NIXL: a step's transfers wait for its
stream fence (``ManualFence`` in test_worker_unit stands in for a CUDA event),
and a fence that never completes drops its transfers unposted."""

from __future__ import annotations

import time
from collections import Counter

import torch

from test_worker_unit import ManualFence, split
from test_worker_unit import gen, harness  # noqa: F401 (fixtures)
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob


def test_cpu_fence_is_always_done():
    from vllm_kvbm.worker.fence import DONE, fence_maker

    make = fence_maker(torch.device("cpu"))
    assert make() is DONE and DONE.done()


def test_store_waits_for_its_fence_and_copies_what_the_forward_wrote(harness, gen):
    h = harness()
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    ((b, s),) = split(gen, 1, 32)
    pool_before = h.pool.clone()
    # wait_for_save: the forward pass that writes these blocks is only launched
    h.worker.start_stores(
        KVBMConnectorMetadata(stores=[TransferJob(1, "A", b, s)], delayed_free_req_ids=["A"])
    )
    for blk in b:  # ... and writes them now, after wait_for_save returned
        h.lay.fill_block(blk, gen)
    for _ in range(30):
        h.step()
        time.sleep(0.001)
    # Nothing was copied (a copy posted at once would have read the old KV),
    # nothing reported, and the blocks stay allocated.
    assert torch.equal(h.pool, pool_before)
    assert not h.meta.stores_done and not h.meta.stores_failed
    assert h.sending == [] and not h.worker._inflight
    fence.is_done = True
    h.step_until(lambda: h.meta.stores_done[1] == 1)
    assert h.pool_holds(b, s)  # the KV as the forward pass left it
    assert h.sending == ["A"] and fence.waits == 0  # polled, never waited on


def test_load_waits_for_its_fence(harness, gen):
    h = harness()
    (bs_, ss), (bl, _) = split(gen, 2, 24)
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "S", bs_, ss)]))
    h.step_until(lambda: h.meta.stores_done[1] == 1)
    want = [h.lay.slot_bytes(b) for b in bs_]
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(2, "L", bl, ss)]))
    # Kernels queued before the fence (vLLM zeroing the newly allocated
    # blocks, a step still running for their previous owner) write them now.
    for b in bl:
        h.lay.zero_block(b)
    for _ in range(30):
        h.step()
        time.sleep(0.001)
    assert h.recving == [] and not h.worker._inflight
    assert all(not h.lay.slot_bytes(b).any() for b in bl)  # not written yet
    fence.is_done = True
    h.step_until(lambda: h.recving == ["L"])
    for b, w in zip(bl, want):  # the loaded pages, not the zeros written before
        assert torch.equal(h.lay.slot_bytes(b), w)
    assert not h.meta.loads_failed


def test_preemption_flush_waits_for_the_fence_then_the_store(harness, gen):
    h = harness()
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    (bp, sp), (bq, sq) = split(gen, 2, 16)
    h.worker.start_stores(
        KVBMConnectorMetadata(stores=[TransferJob(1, "P", bp, sp), TransferJob(2, "Q", bq, sq)])
    )
    h.step()
    assert not h.worker._inflight  # both held back by the fence
    want = torch.stack([h.lay.slot_bytes(b) for b in bp])
    h.worker.handle_preemptions(KVBMConnectorMetadata(flush_req_ids=["P"]))
    assert fence.waits == 1
    assert torch.equal(h.pool[sp], want)  # P's pages are in host RAM on return
    m = h.worker.build_worker_meta()
    assert m is not None and m.stores_done[1] == 1
    h.meta = h.meta.aggregate(m)
    h.step_until(lambda: h.meta.stores_done[2] == 1)
    assert h.pool_holds(bq, sq)


def test_a_fence_that_never_completes_drops_its_transfers_unposted(harness, gen):
    h = harness()
    h.worker.transfer_timeout_s = 0.05
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    (b, s), (bl, sl) = split(gen, 2, 8)
    pool_before, kv_before = h.pool.clone(), h.lay.clone_raw()
    h.worker.start_stores(
        KVBMConnectorMetadata(stores=[TransferJob(1, "S", b, s)], delayed_free_req_ids=["S"])
    )
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(2, "L", bl, sl)]))
    time.sleep(0.06)
    h.step_until(lambda: h.meta.stores_failed[1] == 1 and "L" in h.recving)
    # never posted, so nothing holds host slots; vLLM recomputes the load
    assert h.meta.transfer_timeouts == Counter(not_started=2) and not h.meta.slots_held
    assert h.sending == ["S"] and h.meta.loads_failed == Counter({"L": 1})
    assert h.worker.get_block_ids_with_load_errors() == set(bl)
    fence.is_done = True  # too late: it is never posted
    for _ in range(10):
        h.step()
        time.sleep(0.001)
    assert torch.equal(h.pool, pool_before) and h.lay.raw_equal(kv_before)


def test_shutdown_drops_transfers_still_behind_their_fence(harness, gen):
    h = harness()
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    ((b, s),) = split(gen, 1, 8)
    pool_before = h.pool.clone()
    h.worker.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "S", b, s)]))
    t = time.perf_counter()
    h.worker.shutdown()
    assert time.perf_counter() - t < 5.0 and h.worker.mover is None
    assert fence.waits == 0 and torch.equal(h.pool, pool_before)
