"""The copy-engine path (worker/copy_engine.py) on CPU, with a fake CUDA stream.

The fake stands for what has no CPU equivalent: a stream that runs the
batch later than it is queued and an event that says when. It moves the
real bytes (PyTorch copies over the same views the CUDA fallback uses) only
when the test lets the "GPU" run, so a poll before that must say PROC and a
copy queued before the compute stream's work must be seen waiting for it.
The copy counts are asserted at a 70B model's geometry (80 layers, 8 KV
heads of 128, bf16, 16-token blocks, 256-token pages) at TP=1 and TP=8.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.kv_layouts import VLLM_LAYOUTS, random_fill, vllm_layout
from vllm_kvbm.worker.copy_engine import CopyEngineMover, SpanViews
from vllm_kvbm.worker.copy_path import nixl_page_copies
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs, merge_runs, page_copies
from vllm_kvbm.worker.kv_regions import block_regions
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT

NB = 40


class FakeEvent:
    def __init__(self, stream: "FakeStream"):
        self.stream, self.done = stream, False

    def query(self) -> bool:
        return self.done


class FakeStream:
    """A copy stream: batches run only when ``run()`` is called, in order,
    each after the compute work queued before it (``compute_pending``)."""

    name = "fake CUDA stream"

    def __init__(self, spans: SpanViews):
        self.spans = spans
        self.queued: list[tuple] = []
        self.log: list[str] = []
        self.compute_pending = 0  # kernels queued on the compute stream

    def submit(self, src, dst, sizes, to_host):
        self.log.append(f"wait compute ({self.compute_pending} kernels)")
        event = FakeEvent(self)
        self.queued.append((self.compute_pending, src, dst, sizes, event))
        self.log.append(f"batch of {len(sizes)} copies")
        return event, (src, dst, sizes)

    def run(self) -> None:
        for after, src, dst, sizes, event in self.queued:
            assert after <= 0 or self.compute_pending == 0, "copy ran before the compute"
            torch._foreach_copy_(self.spans.views(dst, sizes), self.spans.views(src, sizes))
            event.done = True
        self.queued = []


def layout(name: str, gen, layers=3, heads=2, block_size=4, head_size=8, nb=NB):
    return vllm_layout(name, layers, nb, heads=heads, block_size=block_size,
                       head_size=head_size, gen=gen, dtype=torch.bfloat16)


def mover_for(lay, slots: int, gen, page_blocks: int = 1):
    pool = torch.empty(slots, lay.block_bytes(), dtype=torch.uint8)
    random_fill(pool, gen)  # garbage: an unwanted write shows
    stream = FakeStream(SpanViews([*lay.caches.values(), pool]))
    m = CopyEngineMover(lay.caches, lay.num_blocks, pool, lay.block_dims, copies=stream,
                        page_blocks=page_blocks)
    return m, pool, stream


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("name", sorted(set(VLLM_LAYOUTS) - {"BHLNC"}))  # BHLNC: refused
def test_store_then_load_moves_exact_bytes_only_when_the_stream_ran(name, gen):
    lay = layout(name, gen)
    m, pool, stream = mover_for(lay, 8, gen)
    blocks, slots = [3, 4, 5, 9], [6, 0, 1, 2]
    h = m.post(True, blocks, slots)
    assert m.poll(h) == "PROC"  # queued, not run: nothing may be reported
    assert not torch.equal(pool[6], lay.slot_bytes(3))
    stream.run()
    assert m.poll(h) == "DONE"
    for b, s in zip(blocks, slots):
        assert torch.equal(pool[s], lay.slot_bytes(b)), (name, b)
    before = lay.clone_raw()
    dst = [20, 21, 22, 30]
    h = m.post(False, dst, slots)
    stream.run()
    assert m.poll(h) == "DONE"
    expected = [r.clone() for r in before]
    for s_blk, d_blk in zip(blocks, dst):
        lay.copy_block(expected, s_blk, d_blk)
    assert torch.equal(lay.raw[0], expected[0])  # the loaded blocks, nothing else


def test_copies_wait_for_the_compute_stream_and_polls_follow_the_step(gen):
    lay = layout("LBNHC", gen)
    m, pool, stream = mover_for(lay, 8, gen)
    stream.compute_pending = 1  # the forward pass that writes block 3 is queued
    h = m.post(True, [3], [0])
    assert stream.log == ["wait compute (1 kernels)", "batch of 3 copies"]
    polls = 0
    for step in range(5):  # engine steps: one poll each
        polls += 1
        if m.poll(h) == "DONE":
            break
        if step == 2:  # the compute finished, then the copy ran
            stream.compute_pending = 0
            stream.run()
    assert polls == 4 and m.poll(h) == "DONE"
    assert torch.equal(pool[0], lay.slot_bytes(3))


def test_out_of_range_post_raises_before_queuing(gen):
    lay = layout("LBNHC", gen)
    m, _, stream = mover_for(lay, 8, gen)
    for blocks, slots in (([NB], [0]), ([0], [8]), ([-1], [0]), ([0, 1], [0])):
        with pytest.raises((IndexError, ValueError)):
            m.post(True, blocks, slots)
    assert stream.queued == []


def test_consecutive_blocks_merge_into_one_copy_in_a_block_major_cache(gen):
    lay = layout("BLNHC", gen)
    m, pool, stream = mover_for(lay, 8, gen, page_blocks=4)
    h = m.post(True, [4, 5, 6, 7], [0, 1, 2, 3])
    assert stream.log[-1] == "batch of 1 copies"
    stream.run()
    assert m.poll(h) == "DONE"
    assert all(torch.equal(pool[i], lay.slot_bytes(4 + i)) for i in range(4))
    assert (m.page_copies.best, m.page_copies.worst) == (1, 4)


# ---- a 70B model's page: copies per page and the smallest copy ----------------

KIB = 1024


def regions_70b(name: str, tp: int):
    """Llama-3-70B's KV cache on one of ``tp`` ranks (8 KV heads split)."""
    lay = vllm_layout(name, 80, 32, heads=8 // tp, block_size=16, head_size=128, gen=None,
                      dtype=torch.bfloat16, pad=0)
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

    lays = {name: layout(name, gen if name == "LBHNC" else None)
            for name in ("LBHNC", BLOCK_MAJOR_LAYOUT, "LBNHC")}
    for name, lay in lays.items():
        for layer, view in lay.caches.items():
            view.copy_(lays["LBHNC"].caches[layer])  # the same KV, logically
    pages, prints = {}, {}
    for name, lay in lays.items():
        m, pool, stream = mover_for(lay, 8, gen)
        m.post(True, [1, 2, 5], [0, 1, 2])
        stream.run()
        pages[name] = pool[:3].clone()
        prints[name] = layout_fingerprint(lay.caches, NB, lay.block_dims)
    assert torch.equal(pages[BLOCK_MAJOR_LAYOUT], pages["LBHNC"])
    assert prints[BLOCK_MAJOR_LAYOUT] == prints["LBHNC"]
    assert not torch.equal(pages["LBNHC"], pages["LBHNC"])
    assert prints["LBNHC"] != prints["LBHNC"]


def test_page_copies_log_line():
    c = page_copies(RegionTable.of(regions_70b("LBNHC", 8)), 16)
    assert str(c) == ("a 16-block page is 1280 copies (consecutive engine blocks) to 1280 "
                      "(scattered), the smallest 8 KiB")
    c = page_copies(RegionTable.of(regions_70b(BLOCK_MAJOR_LAYOUT, 8)), 16)
    assert str(c) == ("a 16-block page is 1 copy (consecutive engine blocks) to 16 "
                      "(scattered), the smallest 640 KiB")



def test_the_chosen_path_is_logged_with_a_measured_round_trip(gen, caplog):
    from helpers.kv_layouts import agent_name
    from vllm_kvbm.worker.copy_path import make_mover

    lay = layout("LBHNC", gen)  # vLLM's CPU layout: host memory, so NIXL's self transport
    pool = torch.zeros(8, lay.block_bytes(), dtype=torch.uint8)
    before = lay.clone_raw()
    with caplog.at_level("INFO", logger="vllm_kvbm.worker.copy_path"):
        m = make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 4)
    try:
        line = caplog.messages[-1]
        assert "copies by NIXL (nixl_cu" in line and "UCX self transport" in line, line
        assert "a 4-block page is 12 copies" in line and " GB/s (4 blocks each way)" in line
        assert torch.equal(lay.raw[0], before[0])  # the round trip left the KV as it was
        assert all(torch.equal(pool[b], lay.slot_bytes(b)) for b in range(4))
    finally:
        m.close()


def test_a_cuda_error_on_the_event_ends_the_transfer_err(gen, caplog):
    lay = layout("LBNHC", gen)
    m, _, stream = mover_for(lay, 8, gen)
    h = m.post(True, [3], [0])

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    h.event.query = broken
    with caplog.at_level("WARNING", logger="vllm_kvbm.worker.copy_engine"):
        assert m.poll(h) == "ERR"
    assert "illegal memory access" in caplog.text and h.keep == ()
