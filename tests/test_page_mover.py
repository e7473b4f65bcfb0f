"""PageMover / page_regions against real NIXL (UCX loopback) on CPU memory."""

from __future__ import annotations

import time

import pytest
import torch

from kv_layouts import KVLayout, agent_name, cpu_layout, flash_layout, random_fill
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.worker.page_mover import PageMover, page_regions

NB = 40  # never 2: a flash layout [2, nb, ...] would be ambiguous


def make_layout(kind: str, gen: torch.Generator) -> KVLayout:
    if kind == "cpu":
        return cpu_layout(num_layers=3, num_blocks=NB, heads=2, block_size=4,
                          head_size=8, gen=gen)
    if kind == "flash":
        return flash_layout(num_layers=3, num_blocks=NB, block_size=4, heads=2,
                            head_dim=8, gen=gen)
    if kind == "flash_hnd":
        return flash_layout(num_layers=2, num_blocks=NB, block_size=4, heads=3,
                            head_dim=8, gen=gen, hnd=True)
    raise AssertionError(kind)


def make_pool(num_slots: int, block_bytes: int, gen: torch.Generator) -> torch.Tensor:
    pool = torch.empty(num_slots, block_bytes, dtype=torch.uint8)
    random_fill(pool, gen)  # garbage, not zeros: an unwanted write shows
    return pool


def wait(mover: PageMover, handle, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = mover.poll(handle)
        if state != "PROC":
            return state
        assert time.monotonic() < deadline, "transfer did not finish"
        time.sleep(0.0002)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def movers():
    made = []
    yield made
    for m in made:
        m.close()


# ---- page_regions ----------------------------------------------------------

def test_regions_cpu_layout_shared_buffer(gen):
    lay = cpu_layout(num_layers=3, num_blocks=NB, heads=2, block_size=4, head_size=8,
                     gen=gen, pad=4096)
    regions = page_regions(lay.caches, NB)
    page = 2 * 4 * 16 * 2  # heads * bs * 2*hs * bf16
    assert len(regions) == 3
    base = lay.raw[0].data_ptr() + 4096
    for i, r in enumerate(regions):
        assert (r.base, r.stride, r.page_bytes) == (base + i * NB * page, page, page)


def test_regions_flash_layout_k_and_v_separate(gen):
    lay = flash_layout(num_layers=2, num_blocks=NB, block_size=4, heads=2, head_dim=8,
                       gen=gen)
    regions = page_regions(lay.caches, NB)
    page = 4 * 2 * 8 * 2
    assert len(regions) == 4  # per layer: K region then V region
    for i, r in enumerate(regions):
        t = lay.raw[i // 2]
        assert r.base == t.data_ptr() + (i % 2) * NB * page
        assert (r.stride, r.page_bytes) == (page, page)


def test_regions_reject_gapped_page(gen):
    # pages padded per row: the block's bytes are not one contiguous run
    t = torch.zeros(NB, 2, 4, 24, dtype=torch.bfloat16)[..., :16]
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        page_regions({"l0": t}, NB)
    # a transposed view with a gap between rows
    tt = torch.zeros(NB, 8, 6)[:, :, :4].transpose(1, 2)
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        page_regions({"l0": tt}, NB)
    # strided (every other block) is fine: only the page must be dense
    assert len(page_regions({"l0": torch.zeros(2 * NB, 4, 8)[::2]}, NB)) == 1


def test_regions_reject_missing_block_dim(gen):
    with pytest.raises(KVBMConfigError, match="num_blocks=40"):
        page_regions({"l0": torch.zeros(2, 39, 4, 8)}, NB)


# ---- PageMover round trips -------------------------------------------------

@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
def test_store_then_load_into_other_blocks(kind, gen, movers):
    lay = make_layout(kind, gen)
    num_slots = 24
    pool = make_pool(num_slots, lay.block_bytes(), gen)
    pool_before = pool.clone()
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    movers.append(mover)
    assert mover.block_bytes == lay.block_bytes()

    perm = torch.randperm(NB, generator=gen).tolist()
    src, dst = perm[:16], perm[16:32]
    slots = torch.randperm(num_slots, generator=gen)[:16].tolist()
    kv_before = lay.clone_raw()

    assert wait(mover, mover.post(True, src, slots)) == "DONE"
    for b, s in zip(src, slots):
        assert torch.equal(pool[s], lay.slot_bytes(b)), f"slot {s} != block {b}"
    untouched = sorted(set(range(num_slots)) - set(slots))
    assert torch.equal(pool[untouched], pool_before[untouched]), "store wrote other slots"
    assert lay.raw_equal(kv_before), "store changed the KV cache"

    # load into different blocks: zero them first, then expect src's pages there
    for b in dst:
        lay.zero_block(b)
    expected = lay.clone_raw()
    for s_blk, d_blk in zip(src, dst):
        lay.copy_block(expected, s_blk, d_blk)
    pool_after_store = pool.clone()

    assert wait(mover, mover.post(False, dst, slots)) == "DONE"
    for s_blk, d_blk in zip(src, dst):
        assert torch.equal(lay.slot_bytes(d_blk), lay.slot_bytes(s_blk))
    # whole memory byte-equal to the reference: no block (nor guard byte) outside
    # dst changed
    assert lay.raw_equal(expected), "load wrote outside its blocks"
    assert torch.equal(pool, pool_after_store), "load changed the host pool"


def test_concurrent_posts_and_slot_reuse(gen, movers):
    lay = make_layout("flash", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    movers.append(mover)
    h1 = mover.post(True, [1, 2, 3], [0, 1, 2])
    h2 = mover.post(True, [10, 11], [5, 6])
    assert {wait(mover, h1), wait(mover, h2)} == {"DONE"}
    # overwrite slot 1 with another block: the newest store wins
    assert wait(mover, mover.post(True, [30], [1])) == "DONE"
    for b, s in [(1, 0), (30, 1), (3, 2), (10, 5), (11, 6)]:
        assert torch.equal(pool[s], lay.slot_bytes(b))


def test_pool_slot_size_mismatch(gen, movers):
    lay = make_layout("cpu", gen)
    bb = lay.block_bytes()
    for bad in (bb - 1, bb + 256, bb // 2):
        with pytest.raises(KVBMConfigError, match=f"{bb}.*KV layout mismatch"):
            PageMover(lay.caches, NB, torch.zeros(4, bad, dtype=torch.uint8),
                      name=agent_name())
    # same bytes in another dtype is fine
    movers.append(PageMover(lay.caches, NB, torch.zeros(4, bb // 4, dtype=torch.int32),
                            name=agent_name()))


def test_mover_rejects_non_contiguous_layout(gen):
    t = torch.zeros(2, NB, 2, 4, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    t = t[..., :4]  # half of head_dim: gapped pages
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        PageMover({"l0": t}, NB, torch.zeros(4, 64, dtype=torch.uint8), name=agent_name())


@pytest.mark.parametrize("blocks,slots", [
    ([0], [8]),                 # slot == num_slots
    ([0, 1], [7, -1]),          # negative slot
    ([0], [2**32 + 1]),         # wraps to slot 1 in int32 index math
    ([NB], [0]),                # block == num_blocks
    ([-1], [0]),
    ([2**32], [0]),             # wraps to block 0
    ([0, 1], [0]),              # length mismatch
])
def test_out_of_range_post_raises_without_touching_memory(blocks, slots, gen, movers):
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    movers.append(mover)
    pool_before, kv_before = pool.clone(), lay.clone_raw()
    for to_host in (True, False):
        try:
            handle = mover.post(to_host, blocks, slots)
        except Exception:
            continue
        assert wait(mover, handle) == "ERR", f"post({to_host}, {blocks}, {slots}) ran"
    assert torch.equal(pool, pool_before)
    assert lay.raw_equal(kv_before)
    # the mover still works afterwards
    assert wait(mover, mover.post(True, [5], [3])) == "DONE"
    assert torch.equal(pool[3], lay.slot_bytes(5))


def test_close_releases_registration(gen):
    lay = make_layout("flash", gen)
    pool = make_pool(4, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    assert wait(mover, mover.post(True, [7], [2])) == "DONE"
    mover.close()
    # the same memory registers again with a new agent and still moves bytes
    again = PageMover(lay.caches, NB, pool, name=agent_name())
    try:
        assert wait(again, again.post(False, [8], [2])) == "DONE"
        assert torch.equal(lay.slot_bytes(8), lay.slot_bytes(7))
    finally:
        again.close()
