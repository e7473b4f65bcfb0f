"""Plain copies shared by a few threads (worker/host_copies.py), the other host-memory path.

Real layouts of vLLM's KV cache (helpers/kv_layouts.py), real threads: every
byte lands where NIXL's path puts it, in both directions, whichever thread
copies which piece; a copy cut into pieces comes out whole; ids out of range
are refused before anything is copied; and make_mover measures both host
paths and keeps one, logging the other's figures.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from helpers.kv_layouts import agent_name, vllm_layout
from test_page_mover import NB, make_layout, make_pool, movers  # noqa: F401 (fixture)
from vllm_kvbm.worker import host_copies
from vllm_kvbm.worker.copy_path import make_mover
from vllm_kvbm.worker.host_copies import HostCopies, pieces


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
@pytest.mark.parametrize("threads", [1, 3])
def test_both_directions_move_every_byte_and_nothing_else(kind, threads, gen, movers, monkeypatch):
    monkeypatch.setattr(host_copies, "PIECE_BYTES", 256)  # many pieces for the threads
    monkeypatch.setattr(host_copies, "HELP_BYTES", 0)  # and the helpers woken for each job
    lay = make_layout(kind, gen)
    pool = make_pool(12, lay.block_bytes(), gen)
    mover = HostCopies(lay.caches, NB, pool, threads=threads)
    movers.append(mover)
    assert mover.threads == threads and len(mover._helpers) == threads - 1
    blocks, slots = [1, 2, 3, 17, 30], [7, 0, 3, 11, 4]
    rows_before = pool.clone()
    assert mover.poll(mover.post(True, blocks, slots)) == "DONE"
    for b, s in zip(blocks, slots):
        assert torch.equal(pool[s], lay.slot_bytes(b))
    for s in set(range(12)) - set(slots):
        assert torch.equal(pool[s], rows_before[s])  # no other row written
    before = lay.clone_raw()
    assert mover.post(False, [20, 21, 22], [7, 0, 3]) == "DONE"
    for a, b in [(1, 20), (2, 21), (3, 22)]:
        assert torch.equal(lay.slot_bytes(b), lay.slot_bytes(a, before))
    for b in set(range(NB)) - {20, 21, 22}:
        assert torch.equal(lay.slot_bytes(b), lay.slot_bytes(b, before))  # no other block


def test_pieces_cover_each_copy_once_and_whole():
    src = np.array([0, 10_000, 50_000], dtype=np.int64)
    dst = np.array([100_000, 300_000, 200_000], dtype=np.int64)
    sizes = np.array([2500, 1000, 4097], dtype=np.int64)
    s, d, n = pieces(src, dst, sizes, piece=1000)
    assert max(n) <= 1000 and sum(n) == int(sizes.sum())
    covered = sorted(zip(s, d, n))
    for (s0, d0, n0), (s1, d1, _) in zip(covered, covered[1:]):
        if s1 == s0 + n0:  # the next piece of the same copy continues both sides
            assert d1 == d0 + n0
    assert pieces(src, dst, sizes, piece=1 << 20) == (src.tolist(), dst.tolist(), sizes.tolist())


def test_ids_out_of_range_are_refused_before_any_copy(gen, movers):
    lay = make_layout("cpu", gen)
    pool = make_pool(4, lay.block_bytes(), gen)
    before = pool.clone()
    mover = HostCopies(lay.caches, NB, pool, threads=2)
    movers.append(mover)
    with pytest.raises(IndexError):
        mover.post(True, [1, NB], [0, 1])
    with pytest.raises(IndexError):
        mover.post(True, [1, 2], [0, 4])
    assert torch.equal(pool, before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_helpers_are_not_bound_to_the_posting_threads_core(gen, movers):
    lay = make_layout("cpu", gen)
    pool = make_pool(4, lay.block_bytes(), gen)
    allowed = os.sched_getaffinity(0)
    made = []

    def make():  # from a thread pinned to one core, as vLLM pins the engine thread
        os.sched_setaffinity(0, {min(allowed)})
        made.append(HostCopies(lay.caches, NB, pool, threads=2))

    t = threading.Thread(target=make)
    t.start()
    t.join()
    movers.append(made[0])
    [helper] = made[0]._helpers
    deadline = time.monotonic() + 10  # widened first thing when it starts
    while os.sched_getaffinity(helper.native_id) != allowed:
        assert time.monotonic() < deadline, os.sched_getaffinity(helper.native_id)
        time.sleep(0.01)


def test_make_mover_keeps_the_faster_host_path_and_logs_both(gen, caplog):
    lay = vllm_layout("LBHNC", 3, NB, heads=2, block_size=4, head_size=8, gen=gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    with caplog.at_level("INFO", logger="vllm_kvbm.worker.copy_path"):
        m = make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 2)
    try:
        line = caplog.messages[-1]
        kept = "memory copies in" if isinstance(m, HostCopies) else "NIXL (nixl_cu"
        other = "NIXL (nixl_cu" if isinstance(m, HostCopies) else "memory copies in"
        assert f"copies by {kept}" in line, line
        assert f"(the faster measured; {other}" in line and line.count(" GB/s") == 4, line
    finally:
        m.close()


@pytest.mark.parametrize("path", ["nixl", "threads"])
def test_host_copy_path_fixes_the_path_and_still_checks_it(gen, caplog, path):
    """host_copy_path names one path: only it is made, its round trip still
    checks every byte, and the startup line says the setting chose it."""
    lay = vllm_layout("LBHNC", 3, NB, heads=2, block_size=4, head_size=8, gen=gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    with caplog.at_level("INFO", logger="vllm_kvbm.worker.copy_path"):
        m = make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 2, path)
    try:
        assert isinstance(m, HostCopies) == (path == "threads")
        line = caplog.messages[-1]
        assert line.endswith("(host_copy_path)") and "faster measured" not in line, line
        assert line.count(" GB/s") == 2, line  # its own round trip
    finally:
        m.close()
