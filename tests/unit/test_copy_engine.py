"""The copy-engine path (worker/copy_engine.py) on CPU: the real CudaCopies over a fake CUDA.

No GPU here: ``helpers.fake_cuda.FakeCuda`` stands in for torch.cuda's streams
and events. It orders nothing by itself: each stream queues what the code
asked for, and the test runs the queued work copy streams first wherever
the code's waits allow it, so a copy the code did not order after a kernel
runs before it and copies the bytes from before (a control with the wait
left out shows it). Copies move the real bytes by address when they run.
vLLM's batch copy and PyTorch's per-copy fallback are both run. The copy
counts are asserted at a 70B model's geometry (80 layers, 8 KV heads of 128,
bf16, 16-token blocks, 256-token pages) at TP=1 and TP=8.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from helpers.fake_cuda import BYTES_PER_S, FakeCuda
from helpers.kv_layouts import VLLM_LAYOUTS, random_fill, vllm_layout
from vllm_kvbm.worker import copy_engine
from vllm_kvbm.worker.copy_engine import CopyEngineMover, CudaCopies, SpanViews
from vllm_kvbm.worker.copy_path import nixl_page_copies
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs, merge_runs, page_copies
from vllm_kvbm.worker.fence import CudaFence
from vllm_kvbm.worker.kv_regions import block_regions
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT

NB = 40
CPU = torch.device("cpu")


def layout(name: str, gen, layers=3, heads=2, block_size=4, head_size=8, nb=NB):
    return vllm_layout(
        name,
        layers,
        nb,
        heads=heads,
        block_size=block_size,
        head_size=head_size,
        gen=gen,
        dtype=torch.bfloat16,
    )


def copies_for(cuda: FakeCuda, spans: SpanViews, batch: bool = True, cls=CudaCopies):
    """The real CudaCopies over the fake: vLLM's batch copy, or the fallback."""
    found = (cuda.swap_blocks_batch, "") if batch else (None, "no batch copy (test)")
    return cls(CPU, spans, cuda=cuda, find_batch=lambda: found, foreach_copy=cuda.foreach_copy)


def mover_for(lay, slots: int, gen, page_blocks: int = 1, batch: bool = True, cls=CudaCopies):
    pool = torch.empty(slots, lay.block_bytes(), dtype=torch.uint8)
    random_fill(pool, gen)  # garbage: an unwanted write shows
    cuda = FakeCuda()
    copies = copies_for(cuda, SpanViews([*lay.caches.values(), pool]), batch, cls)
    m = CopyEngineMover(
        lay.caches, lay.num_blocks, pool, lay.block_dims, copies=copies, page_blocks=page_blocks
    )
    return m, pool, cuda


class Unordered(CudaCopies):
    """The control: copies that wait for nothing. What the fake must catch."""

    def order(self, stream, after) -> None:
        pass


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("batch", [True, False], ids=["swap_blocks_batch", "foreach_copy"])
@pytest.mark.parametrize("name", sorted(set(VLLM_LAYOUTS) - {"BHLNC"}))  # BHLNC: refused
def test_store_then_load_moves_exact_bytes_only_when_the_stream_ran(name, batch, gen):
    lay = layout(name, gen)
    m, pool, cuda = mover_for(lay, 8, gen, batch=batch)
    blocks, slots = [3, 4, 5, 9], [6, 0, 1, 2]
    h = m.post(True, blocks, slots)
    assert m.poll(h) == "PROC"  # queued, not run: nothing may be reported
    assert not torch.equal(pool[6], lay.slot_bytes(3))
    cuda.run()
    assert m.poll(h) == "DONE" and h.keep == ()
    for b, s in zip(blocks, slots):
        assert torch.equal(pool[s], lay.slot_bytes(b)), (name, b)
    before = lay.clone_raw()
    dst = [20, 21, 22, 30]
    h = m.post(False, dst, slots)
    cuda.run()
    assert m.poll(h) == "DONE"
    expected = [r.clone() for r in before]
    for s_blk, d_blk in zip(blocks, dst):
        lay.copy_block(expected, s_blk, d_blk)
    assert torch.equal(lay.raw[0], expected[0])  # the loaded blocks, nothing else


@pytest.mark.parametrize("batch", [True, False], ids=["swap_blocks_batch", "foreach_copy"])
def test_a_store_reads_its_blocks_after_the_forward_the_fence_follows(batch, gen):
    """The forward pass is launched, then wait_for_save records the fence and
    posts at once: the copy stream waits for the fence's event, so the host
    page holds the KV the forward wrote. Without the wait (the control), the
    fake runs the copy first and the page is stale."""
    for cls, fresh in ((CudaCopies, True), (Unordered, False)):
        lay = layout("LBNHC", gen)
        m, pool, cuda = mover_for(lay, 8, gen, batch=batch, cls=cls)
        cuda.launch(lambda: lay.fill_block(3, gen), "forward writes block 3")
        fence = CudaFence(CPU, cuda)  # wait_for_save, right after the launch
        h = m.post(True, [3], [0], after=fence)
        assert ("stream1: wait_event event0" in cuda.log) == fresh, cuda.log
        cuda.run()
        assert m.poll(h) == "DONE"
        assert torch.equal(pool[0], lay.slot_bytes(3)) == fresh, cls.__name__


def test_the_wait_is_for_the_fence_not_for_work_queued_after_it(gen):
    lay = layout("BLHNC", gen)
    m, pool, cuda = mover_for(lay, 8, gen)
    cuda.launch(lambda: lay.fill_block(3, gen), "forward writes block 3")
    fence = CudaFence(CPU, cuda)
    h = m.post(True, [3], [0], after=fence)
    cuda.launch(lambda: lay.fill_block(3, gen), "the next step's forward")
    assert cuda.log == [
        "compute: kernel forward writes block 3",
        "compute: record event0",
        "stream1: wait_event event0",
        "stream1: kernel batch of 1 copies",
        "stream1: record event1",
        "compute: kernel the next step's forward",
    ]
    cuda.run(until=lambda: m.poll(h) == "DONE")
    assert cuda.compute.queue  # the next step's forward has not run: nothing waited for it
    kv_at_fence = lay.slot_bytes(3)  # what the first forward wrote
    cuda.run()
    assert not torch.equal(lay.slot_bytes(3), kv_at_fence)  # rewritten after the copy


def test_a_load_lands_after_the_kernels_queued_before_start_load_kv(gen):
    lay = layout("LBNHC", gen)
    m, pool, cuda = mover_for(lay, 8, gen)
    h = m.post(True, [3], [0])  # a stored page
    cuda.run()
    want = pool[0].clone()
    for cls, lands in ((CudaCopies, True), (Unordered, False)):
        m.copies = copies_for(cuda, m.copies._spans, True, cls)
        cuda.launch(lambda: lay.zero_block(7), "zeroing of newly allocated block 7")
        h = m.post(False, [7], [0], after=CudaFence(CPU, cuda))  # start_load_kv
        cuda.run()
        assert m.poll(h) == "DONE"
        assert torch.equal(lay.slot_bytes(7), want) == lands, cls.__name__


def test_a_load_does_not_queue_behind_a_store(gen):
    """Stores and loads have a stream each: a load whose fence is passed runs
    while a store still waits for a long forward pass."""
    lay = layout("BLHNC", gen)
    m, pool, cuda = mover_for(lay, 8, gen)
    m.post(True, [1], [1])  # a store that ran: its stream has been used
    cuda.run()
    load_fence = CudaFence(CPU, cuda)  # start_load_kv: nothing pending on its blocks
    cuda.launch(lambda: lay.fill_block(3, gen), "a long forward", seconds=1.0)
    store = m.post(True, [3], [0], after=CudaFence(CPU, cuda))  # wait_for_save
    load = m.post(False, [9], [1], after=load_fence)
    cuda.run(until=lambda: m.poll(load) == "DONE")
    assert m.poll(store) == "PROC" and cuda.compute.queue  # the forward is still running
    assert torch.equal(lay.slot_bytes(9), pool[1])
    cuda.run()
    assert m.poll(store) == "DONE" and torch.equal(pool[0], lay.slot_bytes(3))
    streams = {line.split(":")[0] for line in cuda.log if "batch" in line}
    assert len(streams) == 2


def test_a_post_without_a_fence_waits_for_everything_queued_on_the_engines_stream(gen):
    lay = layout("LBNHC", gen)
    m, pool, cuda = mover_for(lay, 8, gen)
    cuda.launch(lambda: lay.fill_block(5, gen), "a kernel writing block 5")
    h = m.post(True, [5], [2])  # the startup round trip: no step, no fence
    assert "stream1: wait_stream compute" in cuda.log
    cuda.run()
    assert m.poll(h) == "DONE" and torch.equal(pool[2], lay.slot_bytes(5))


def test_timed_copies_report_their_time_on_the_gpu(gen):
    lay = layout("BLHNC", gen)
    m, pool, cuda = mover_for(lay, 8, gen)
    h = m.post(True, [0, 1, 2, 3], [0, 1, 2, 3], timed=True)
    assert m.post(True, [4], [4]).seconds() is None  # untimed
    cuda.run()
    assert m.poll(h) == "DONE"
    assert h.seconds() == pytest.approx(4 * lay.block_bytes() / BYTES_PER_S)


def test_the_worker_posts_at_once_and_the_gpu_orders_the_copies(gen):
    """KVBMWorker with the copy engines: wait_for_save's stores are posted in
    that call with the step's fence (no host poll of it, nothing pending),
    and they copy what the forward launched before wrote, not what the next
    step's forward writes later."""
    from helpers.kv_layouts import agent_name
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.keys import KeyNamespace
    from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
    from vllm_kvbm.worker.worker import KVBMWorker

    lay = layout(BLOCK_MAJOR_LAYOUT, gen)
    bb = lay.block_bytes()
    ns = KeyNamespace(
        model="m@", dtype="torch.bfloat16", kv_layout="x", block_size=4, page_bytes=bb, tp_size=1
    )
    w = KVBMWorker(EngineInfo(4, bb, lay.num_layers, 1, ns), 8, "UCX", agent_name("kvbm-ce"))
    w.register_kv_caches(lay.caches, NB, lay.block_dims)  # CPU KV: NIXL, replaced here
    w.mover.close()
    cuda = FakeCuda()
    rows = w.host_pool.view(-1, bb)
    w.mover = CopyEngineMover(
        lay.caches,
        NB,
        rows,
        lay.block_dims,
        copies=copies_for(cuda, SpanViews([*lay.caches.values(), rows])),
    )
    w.make_fence = lambda: CudaFence(CPU, cuda)
    cuda.launch(lambda: [lay.fill_block(b, gen) for b in (3, 4)], "forward")
    w.start_stores(
        KVBMConnectorMetadata(
            stores=[TransferJob(1, "A", [3, 4], [0, 1])], delayed_free_req_ids=["A"]
        )
    )
    assert not w._pending and len(w._inflight) == 1  # posted at once
    cuda.launch(lambda: [lay.fill_block(b, gen) for b in (3, 4)], "the next step's forward")
    assert w.get_finished(set()) == (set(), set())  # nothing ran: the store is in flight
    cuda.run(until=lambda: w.mover.poll(w._inflight[0].handle) == "DONE")
    written = [lay.slot_bytes(b) for b in (3, 4)]
    assert w.get_finished(set()) == ({"A"}, set())
    cuda.run()
    assert all(torch.equal(rows[s], x) for s, x in zip((0, 1), written))
    assert not any(torch.equal(rows[s], lay.slot_bytes(b)) for s, b in ((0, 3), (1, 4)))
    meta = w.build_worker_meta()
    assert meta is not None and meta.stores_done[1] == 1
    w.shutdown()


def test_the_per_copy_fallback_is_said_once_with_what_is_missing(gen, caplog):
    copy_engine._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.worker.copy_engine"):
        for _ in range(2):
            m, _, _ = mover_for(layout("LBNHC", gen), 8, gen, page_blocks=4, batch=False)
            assert "PyTorch _foreach_copy_" in m.path
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "no batch copy (test)" in warnings[0] and "cudaMemcpyAsync of its own" in warnings[0]
    assert "a 4-block page is 12 copies" in warnings[0]  # 3 layers x 4 blocks
    copy_engine._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.worker.copy_engine"):
        caplog.clear()
        mover_for(layout("LBNHC", gen), 8, gen, batch=True)
    assert not caplog.records


def test_this_vllm_builds_batch_copy_is_found_or_its_missing_part_named():
    fn, missing = copy_engine.vllm_swap_blocks_batch()
    if fn is None:  # vLLM's CPU build: the op is not registered
        assert "swap_blocks_batch" in missing, missing
    else:
        assert missing == ""


def test_out_of_range_post_raises_before_queuing(gen):
    lay = layout("LBNHC", gen)
    m, _, cuda = mover_for(lay, 8, gen)
    for blocks, slots in (([NB], [0]), ([0], [8]), ([-1], [0]), ([0, 1], [0])):
        with pytest.raises((IndexError, ValueError)):
            m.post(True, blocks, slots)
    assert cuda.log == [] and cuda.idle()


def test_consecutive_blocks_merge_into_one_copy_in_a_block_major_cache(gen):
    lay = layout("BLNHC", gen)
    m, pool, cuda = mover_for(lay, 8, gen, page_blocks=4)
    h = m.post(True, [4, 5, 6, 7], [0, 1, 2, 3])
    assert "stream1: kernel batch of 1 copies" in cuda.log
    cuda.run()
    assert m.poll(h) == "DONE"
    assert all(torch.equal(pool[i], lay.slot_bytes(4 + i)) for i in range(4))
    assert (m.page_copies.best, m.page_copies.worst) == (1, 4)


# ---- a 70B model's page: copies per page and the smallest copy ----------------

KIB = 1024


def regions_70b(name: str, tp: int):
    """Llama-3-70B's KV cache on one of ``tp`` ranks (8 KV heads split)."""
    lay = vllm_layout(
        name,
        80,
        32,
        heads=8 // tp,
        block_size=16,
        head_size=128,
        gen=None,
        dtype=torch.bfloat16,
        pad=0,
    )
    assert lay.block_bytes() == 80 * 2 * (8 // tp) * 128 * 16 * 2
    return block_regions(lay.caches, 32, lay.block_dims)


@pytest.mark.parametrize("tp, layer_block", [(1, 64 * KIB), (8, 8 * KIB)])
def test_70b_page_copies(tp, layer_block):
    # FlashAttention's default layout (layer by layer): the host row holds a
    # block's layers side by side, so nothing merges across layers; NIXL's
    # descriptors are the same 80 x 16 layer blocks.
    lbnhc = regions_70b("LBNHC", tp)
    c = page_copies(RegionTable.of(lbnhc), 16)
    assert (c.best, c.worst, c.smallest) == (1280, 1280, layer_block)
    n = nixl_page_copies(lbnhc, 16)
    assert (n.best, n.worst, n.smallest) == (1280, 1280, layer_block)
    # Laid out block by block across layers (BLHNC: what KVBM asks vLLM for
    # on CUDA, engine_info.py): a page of consecutive blocks is one
    # 80-layer copy (5 MiB blocks x 16 = 80 MiB at TP=1), scattered blocks
    # one copy each (5 MiB at TP=1, 640 KiB at TP=8).
    for name in (BLOCK_MAJOR_LAYOUT, "BLNHC"):
        c = page_copies(RegionTable.of(regions_70b(name, tp)), 16)
        assert (c.best, c.worst, c.smallest) == (1, 16, 80 * layer_block), name


@pytest.mark.parametrize("tp", [1, 8])
def test_a_block_major_block_is_one_entry_before_any_post(tp):
    # Precomputed once: a post lists one entry per block, not one per layer
    # block (41k entries for an 8k-token prefill, 80 times what is copied).
    assert len(RegionTable.of(regions_70b(BLOCK_MAJOR_LAYOUT, tp)).sizes) == 1
    assert len(RegionTable.of(regions_70b("LBNHC", tp)).sizes) == 80


def naive_runs(regions, blocks, rows, to_host):
    """Every layer block its own copy, then merged: what the table must equal."""
    kv, host, sizes, off = [], [], [], 0
    row_bytes = sum(r.layer_block_bytes for r in regions)
    for b, row in zip(blocks, rows):
        off = 0
        for r in regions:
            kv.append(r.base + b * r.stride)
            host.append(row * row_bytes + off)
            sizes.append(r.layer_block_bytes)
            off += r.layer_block_bytes
    kv, host, sizes = (np.array(a, dtype=np.int64) for a in (kv, host, sizes))
    return merge_runs(*((kv, host) if to_host else (host, kv)), sizes)


@pytest.mark.parametrize("name", sorted(set(VLLM_LAYOUTS) - {"BHLNC"}))
def test_joined_regions_copy_exactly_what_each_layer_block_would(name, gen):
    lay = layout(name, None, layers=4, heads=2, block_size=4, head_size=8)
    regions = block_regions(lay.caches, NB, lay.block_dims)
    table = RegionTable.of(regions)
    for trial in range(20):
        blocks = torch.randperm(NB, generator=gen)[:6].tolist()
        if trial % 2:
            blocks = sorted(blocks)
        rows = torch.randperm(8, generator=gen)[:6].tolist()
        for to_host in (True, False):
            got = copy_runs(table, 0, np.array(blocks), np.array(rows), to_host)
            want = naive_runs(regions, blocks, rows, to_host)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), (name, blocks, rows)


def test_a_page_under_the_block_major_layout_is_the_same_bytes_and_identity_as_lbhnc(gen):
    # The order of blocks and layers in the engine changes only the copies:
    # a page holds the same bytes (and the same layout fingerprint in its
    # header) as under LBHNC, vLLM's CPU layout. Under LBNHC (another
    # interior) both differ, so such a page is never read as this one.
    from vllm_kvbm.worker.tier_io import layout_fingerprint

    lays = {
        name: layout(name, gen if name == "LBHNC" else None)
        for name in ("LBHNC", BLOCK_MAJOR_LAYOUT, "LBNHC")
    }
    for name, lay in lays.items():
        for layer, view in lay.caches.items():
            view.copy_(lays["LBHNC"].caches[layer])  # the same KV, logically
    pages, prints = {}, {}
    for name, lay in lays.items():
        m, pool, cuda = mover_for(lay, 8, gen)
        m.post(True, [1, 2, 5], [0, 1, 2])
        cuda.run()
        pages[name] = pool[:3].clone()
        prints[name] = layout_fingerprint(lay.caches, NB, lay.block_dims)
    assert torch.equal(pages[BLOCK_MAJOR_LAYOUT], pages["LBHNC"])
    assert prints[BLOCK_MAJOR_LAYOUT] == prints["LBHNC"]
    assert not torch.equal(pages["LBNHC"], pages["LBHNC"])
    assert prints["LBNHC"] != prints["LBHNC"]


def test_page_copies_log_line():
    c = page_copies(RegionTable.of(regions_70b("LBNHC", 8)), 16)
    assert str(c) == (
        "a 16-block page is 1280 copies (consecutive engine blocks) to 1280 "
        "(scattered), the smallest 8 KiB"
    )
    c = page_copies(RegionTable.of(regions_70b(BLOCK_MAJOR_LAYOUT, 8)), 16)
    assert str(c) == (
        "a 16-block page is 1 copy (consecutive engine blocks) to 16 "
        "(scattered), the smallest 640 KiB"
    )


def test_a_cuda_error_on_the_event_ends_the_transfer_err(gen, caplog):
    lay = layout("LBNHC", gen)
    m, _, cuda = mover_for(lay, 8, gen)
    h = m.post(True, [3], [0])

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    h.event.query = broken
    with caplog.at_level("WARNING", logger="vllm_kvbm.worker.copy_engine"):
        assert m.poll(h) == "ERR"
    assert "illegal memory access" in caplog.text and h.keep == ()
