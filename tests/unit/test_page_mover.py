"""PageMover / block_regions against real NIXL (UCX loopback) on CPU memory."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.kv_layouts import (
    KVLayout,
    agent_name,
    cpu_layout,
    flash_layout,
    random_fill,
)
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.worker.page_mover import (
    NixlBuildError,
    PageMover,
    block_regions,
    load_nixl,
    nixl_builds_for,
)

NB = 40  # never 2: a flash layout [2, nb, ...] would be ambiguous


def make_layout(kind: str, gen: torch.Generator) -> KVLayout:
    if kind == "cpu":
        return cpu_layout(num_layers=3, num_blocks=NB, heads=2, block_size=4, head_size=8, gen=gen)
    if kind == "flash":
        return flash_layout(num_layers=3, num_blocks=NB, block_size=4, heads=2, head_dim=8, gen=gen)
    if kind == "flash_hnd":
        return flash_layout(
            num_layers=2, num_blocks=NB, block_size=4, heads=3, head_dim=8, gen=gen, hnd=True
        )
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


# ---- block_regions ---------------------------------------------------------


def test_regions_cpu_layout_shared_buffer(gen):
    lay = cpu_layout(
        num_layers=3, num_blocks=NB, heads=2, block_size=4, head_size=8, gen=gen, pad=4096
    )
    regions = block_regions(lay.caches, NB)
    page = 2 * 4 * 16 * 2  # heads * bs * 2*hs * bf16
    assert len(regions) == 3
    base = lay.raw[0].data_ptr() + 4096
    for i, r in enumerate(regions):
        assert (r.base, r.stride, r.layer_block_bytes) == (base + i * NB * page, page, page)


def test_regions_flash_layout_k_and_v_separate(gen):
    lay = flash_layout(num_layers=2, num_blocks=NB, block_size=4, heads=2, head_dim=8, gen=gen)
    regions = block_regions(lay.caches, NB)
    page = 4 * 2 * 8 * 2
    assert len(regions) == 4  # per layer: K region then V region
    for i, r in enumerate(regions):
        t = lay.raw[i // 2]
        assert r.base == t.data_ptr() + (i % 2) * NB * page
        assert (r.stride, r.layer_block_bytes) == (page, page)


def test_regions_reject_gapped_layer_block(gen):
    # layer blocks padded per row: a block's bytes are not one contiguous run
    t = torch.zeros(NB, 2, 4, 24, dtype=torch.bfloat16)[..., :16]
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        block_regions({"l0": t}, NB)
    # a transposed view with a gap between rows
    tt = torch.zeros(NB, 8, 6)[:, :, :4].transpose(1, 2)
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        block_regions({"l0": tt}, NB)
    # strided (every other block) is fine: only the layer block must be dense
    assert len(block_regions({"l0": torch.zeros(2 * NB, 4, 8)[::2]}, NB)) == 1


def test_regions_reject_missing_block_dim(gen):
    with pytest.raises(KVBMConfigError, match="num_blocks=40"):
        block_regions({"l0": torch.zeros(2, 39, 4, 8)}, NB)


# ---- PageMover round trips -------------------------------------------------


@pytest.mark.parametrize(
    "kind,loopback",
    [
        ("cpu", "self"),
        ("flash", "self"),
        ("flash_hnd", "self"),
        ("cpu", "default"),
        ("flash_hnd", "default"),
    ],
)
def test_store_then_load_into_other_blocks(kind, loopback, gen, movers):
    lay = make_layout(kind, gen)
    num_slots = 24
    pool = make_pool(num_slots, lay.block_bytes(), gen)
    pool_before = pool.clone()
    mover = PageMover(lay.caches, NB, pool, name=agent_name(), loopback=loopback)
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


def test_host_copies_are_done_when_post_returns(gen, movers):
    # On CPU a store posted after the forward pass is reported in the same
    # step's get_finished, so a finished request's blocks are freed at once
    # (a cache reset right after a request finds them free).
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    movers.append(mover)
    assert mover.poll(mover.post(True, [11, 12], [4, 5])) == "DONE"
    assert torch.equal(pool[4], lay.slot_bytes(11)) and torch.equal(pool[5], lay.slot_bytes(12))
    assert mover.poll(mover.post(False, [30], [5])) == "DONE"
    assert torch.equal(lay.slot_bytes(30), lay.slot_bytes(12))


@pytest.mark.parametrize("copy_thread", [False, True])
def test_store_then_load_with_and_without_copy_thread(copy_thread, gen, movers):
    lay = make_layout("flash", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name(), copy_thread=copy_thread)
    movers.append(mover)
    assert wait(mover, mover.post(True, [1, 2, 3], [7, 0, 3])) == "DONE"
    assert wait(mover, mover.post(False, [20, 21, 22], [7, 0, 3])) == "DONE"
    for a, b in [(1, 20), (2, 21), (3, 22)]:
        assert torch.equal(lay.slot_bytes(a), lay.slot_bytes(b))


def test_user_ucx_tls_without_self_still_moves_the_right_bytes(gen, movers, monkeypatch):
    # NIXL applies the host loopback's TLS=self only when UCX_TLS is unset: a
    # user's choice without the self transport must still copy both ways.
    monkeypatch.setenv("UCX_TLS", "cma,tcp")
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name())
    movers.append(mover)
    assert wait(mover, mover.post(True, [4, 9], [6, 2])) == "DONE"
    assert torch.equal(pool[6], lay.slot_bytes(4)) and torch.equal(pool[2], lay.slot_bytes(9))
    assert wait(mover, mover.post(False, [20], [2])) == "DONE"
    assert torch.equal(lay.slot_bytes(20), lay.slot_bytes(9))


def test_close_lets_queued_copies_finish(gen):
    # The copy thread ends only after what was posted before close() ran:
    # deregistering memory under a running copy would be undefined.
    lay = make_layout("cpu", gen)
    pool = make_pool(8, lay.block_bytes(), gen)
    mover = PageMover(lay.caches, NB, pool, name=agent_name(), copy_thread=True)
    handles = [mover.post(True, [b], [s]) for b, s in [(3, 0), (4, 1), (5, 2), (6, 3)]]
    mover.close()
    assert [mover.poll(h) for h in handles] == ["DONE"] * 4
    for b, s in [(3, 0), (4, 1), (5, 2), (6, 3)]:
        assert torch.equal(pool[s], lay.slot_bytes(b))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_copy_thread_is_not_bound_to_the_engine_threads_core(gen, movers):
    # vLLM binds its engine thread to its OpenMP cores; the copy thread it
    # starts must not inherit that and queue behind the forward pass.
    allowed = os.sched_getaffinity(0)
    lay = make_layout("cpu", gen)
    pool = make_pool(4, lay.block_bytes(), gen)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        mover = PageMover(lay.caches, NB, pool, name=agent_name(), copy_thread=True)
        movers.append(mover)
        assert wait(mover, mover.post(True, [1], [0])) == "DONE"  # the thread is running
        copy = next(
            t
            for t in threading.enumerate()
            if t.name.endswith("-copy") and t.name.startswith(mover.agent.name)
        )
        assert os.sched_getaffinity(copy.native_id) == allowed
    finally:
        os.sched_setaffinity(0, allowed)


def test_pool_slot_size_mismatch(gen, movers):
    lay = make_layout("cpu", gen)
    bb = lay.block_bytes()
    for bad in (bb - 1, bb + 256, bb // 2):
        with pytest.raises(KVBMConfigError, match=f"{bb}.*KV layout mismatch"):
            PageMover(lay.caches, NB, torch.zeros(4, bad, dtype=torch.uint8), name=agent_name())
    # same bytes in another dtype is fine
    movers.append(
        PageMover(lay.caches, NB, torch.zeros(4, bb // 4, dtype=torch.int32), name=agent_name())
    )


def test_mover_rejects_non_contiguous_layout(gen):
    t = torch.zeros(2, NB, 2, 4, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    t = t[..., :4]  # half of head_dim: gapped pages
    with pytest.raises(KVBMConfigError, match="not contiguous"):
        PageMover({"l0": t}, NB, torch.zeros(4, 64, dtype=torch.uint8), name=agent_name())


@pytest.mark.parametrize(
    "blocks,slots",
    [
        ([0], [8]),  # slot == num_slots
        ([0, 1], [7, -1]),  # negative slot
        ([0], [2**32 + 1]),  # wraps to slot 1 in int32 index math
        ([NB], [0]),  # block == num_blocks
        ([-1], [0]),
        ([2**32], [0]),  # wraps to block 0
        ([0, 1], [0]),  # length mismatch
    ],
)
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


# ---- which NIXL build --------------------------------------------------------


def test_nixl_build_follows_the_cuda_runtime():
    assert nixl_builds_for("12.8") == ["nixl_cu12"]
    assert nixl_builds_for("13.0") == ["nixl_cu13"]
    assert nixl_builds_for(None) == ["nixl_cu12", "nixl_cu13"]  # CPU torch: any
    assert nixl_builds_for(None, "6.4") == ["nixl_rocm"]


def test_mover_uses_the_loaded_matching_nixl_build(gen, movers):
    lay = make_layout("cpu", gen)
    mover = PageMover(lay.caches, NB, make_pool(4, lay.block_bytes(), gen), name=agent_name())
    movers.append(mover)
    assert mover.nixl_module in ("nixl_cu12", "nixl_cu13")
    assert mover.nixl_module in sys.modules
    other = "nixl_cu13" if mover.nixl_module == "nixl_cu12" else "nixl_cu12"
    # PyTorch built for the other CUDA major: its NIXL cannot join this process
    with pytest.raises(
        NixlBuildError, match=f"needs NIXL's {other} build.*pip install {other.replace('_', '-')}"
    ):
        load_nixl(f"{other[-2:]}.0")


@pytest.mark.parametrize(
    "cuda,missing", [("13.0", "nixl_cu13"), ("12.4", "nixl_cu12"), (None, "both")]
)
def test_missing_nixl_build_names_the_package_to_install(cuda, missing):
    """A fresh interpreter where the matching build cannot be imported."""
    block = ["nixl_cu12", "nixl_cu13"] if missing == "both" else [missing]
    code = f"""
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {block!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
from vllm_kvbm.worker.page_mover import NixlBuildError, load_nixl
try:
    load_nixl({cuda!r})
except NixlBuildError as err:
    print(err)
else:
    print("loaded")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    msg = out.stdout.strip().splitlines()[-1]
    want = "nixl-cu12" if missing == "both" else missing.replace("_", "-")
    assert "not installed" in msg and f"pip install {want}" in msg, msg
    if cuda:
        assert f"CUDA {cuda}" in msg, msg
