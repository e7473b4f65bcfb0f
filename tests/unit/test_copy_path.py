"""The startup round trip (worker/copy_path.py): timed, every byte checked, a broken path stops the engine.

On CPU the paths are NIXL's UCX self transport and plain copies in threads,
both real (the faster kept; test_host_copies.py); the copy engines run over
the fake CUDA of helpers/fake_cuda.py (no GPU here), which also gives the
event timing a known answer. A path that copies wrong bytes cannot be made
on purpose with real NIXL, so a wrapper around the real mover changes what
one transfer did (a byte flipped, a load that writes nothing): a mock only
for the fault under test.
"""

from __future__ import annotations

import pytest
import torch

from helpers.fake_cuda import BYTES_PER_S, FakeCuda
from helpers.kv_layouts import agent_name, random_fill, vllm_layout
from vllm_kvbm.worker import copy_path
from vllm_kvbm.worker.copy_engine import CopyEngineMover, CudaCopies, SpanViews
from vllm_kvbm.worker.copy_path import CopyPathError, make_mover, round_trip
from vllm_kvbm.worker.page_mover import PageMover

NB = 40


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


def layout(name: str, gen, nb: int = NB):
    return vllm_layout(
        name, 3, nb, heads=2, block_size=4, head_size=8, gen=gen, dtype=torch.bfloat16
    )


def test_the_chosen_path_is_logged_with_a_checked_timed_round_trip(gen, caplog):
    lay = layout("LBHNC", gen)  # vLLM's CPU layout: host memory, so NIXL's self transport
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    before = lay.clone_raw()
    with caplog.at_level("INFO", logger="vllm_kvbm.worker.copy_path"):
        m = make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 2)
    try:
        line = caplog.messages[-1]
        # the faster of NIXL's self transport and plain copies in threads (test_host_copies.py)
        assert "NIXL (nixl_cu" in line and "UCX self transport" in line, line
        assert "copies by NIXL" in line or "copies by memory copies in " in line, line
        assert "a 2-block page is 6 copies" in line, line
        # 4 pages of 2 blocks (8 of 20 host rows, the complement in 8 more)
        assert "round trip of 8 blocks (0.0 MiB) each way, every byte checked: store " in line
        assert (
            " GB/s, load " in line
            and "(until done, one transfer each way, after a one-page " in line
        )
        assert torch.equal(lay.raw[0], before[0])  # the round trip left the KV as it was
        assert all(torch.equal(pool[b], lay.slot_bytes(b)) for b in range(8))
        assert all(torch.equal(pool[8 + b], ~lay.slot_bytes(b)) for b in range(8))
    finally:
        m.close()


class Broken:
    """The real mover, with one kind of transfer doing something else."""

    def __init__(self, mover, pool, lay, fault: str):
        self.m, self.pool, self.lay, self.fault = mover, pool, lay, fault
        self.regions, self.num_blocks, self.path = mover.regions, mover.num_blocks, mover.path

    def post(self, to_host, blocks, rows):
        if self.fault == "load writes nothing" and not to_host:
            return "nothing"
        handle = self.m.post(to_host, blocks, rows)
        if self.fault == "store flips a byte" and to_host and 5 in blocks:
            self.pool[rows[blocks.index(5)], 700] ^= 0x10
        return handle

    def poll(self, handle):
        if handle == "nothing":
            return "DONE"
        return {"ends ERR": "ERR", "never ends": "PROC"}.get(self.fault) or self.m.poll(handle)


@pytest.mark.parametrize(
    "fault, says",
    [
        ("store flips a byte", "store: engine block 5 and host row 5 differ first at byte "),
        ("load writes nothing", "load: engine block 0 and host row 8 differ first at byte 0 "),
        ("ends ERR", "warm-up store: the transfer ended ERR"),
    ],
)
def test_a_round_trip_that_copies_wrong_bytes_or_fails_stops_the_engine(gen, fault, says):
    lay = layout("LBHNC", gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    real = PageMover(lay.caches, NB, pool, name=agent_name(), block_dims=lay.block_dims)
    try:
        with pytest.raises(CopyPathError) as err:
            round_trip(Broken(real, pool, lay, fault), lay.caches, pool, 2)
    finally:
        real.close()
    text = str(err.value)
    assert says in text, text
    assert "through NIXL" in text and "the engine does not start" in text


def test_a_transfer_that_never_ends_is_an_error_and_the_mover_stays_open(gen, monkeypatch):
    """It may still write: make_mover leaves the mover (and its memory) alone."""
    monkeypatch.setattr(copy_path, "ROUND_TRIP_TIMEOUT_S", 0.05)
    lay = layout("LBHNC", gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    made, closed = [], []

    def never_ends(kv, nb, rows, **kwargs):
        made.append(PageMover(kv, nb, rows, **kwargs))
        b = Broken(made[0], rows, lay, "never ends")
        b.close = lambda: closed.append(True)
        return b

    import vllm_kvbm.worker.page_mover as page_mover

    monkeypatch.setattr(page_mover, "PageMover", never_ends)
    try:
        with pytest.raises(copy_path.Unfinished, match="warm-up store: not finished within 0.05 s"):
            make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 2)
        assert not closed
    finally:
        made[0].close()


def test_the_worker_does_not_start_on_a_path_that_copies_wrong_bytes(gen, monkeypatch):
    """make_mover, as register_kv_caches calls it: the error reaches vLLM,
    and the mover is closed."""
    lay = layout("LBHNC", gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    made = []

    def broken_mover(kv, nb, rows, **kwargs):
        real = PageMover(kv, nb, rows, **kwargs)
        made.append(real)
        b = Broken(real, rows, lay, "store flips a byte")
        b.close = real.close
        return b

    import vllm_kvbm.worker.page_mover as page_mover

    monkeypatch.setattr(page_mover, "PageMover", broken_mover)
    closed = []
    real_close = PageMover.close
    monkeypatch.setattr(PageMover, "close", lambda self: (closed.append(self), real_close(self)))
    with pytest.raises(
        CopyPathError,
        match="store: engine block 5 and host row 5 differ first "
        "at byte 188 of layer block region 3 of 3",
    ):
        make_mover(lay.caches, NB, pool, "UCX", agent_name(), lay.block_dims, 2)
    assert closed == made  # the mover was closed: nothing of it outlives the error


def test_the_copy_engines_round_trip_is_timed_by_cuda_events(gen, caplog):
    lay = layout("BLHNC", gen)
    pool = torch.zeros(20, lay.block_bytes(), dtype=torch.uint8)
    random_fill(pool, gen)
    cuda = FakeCuda()
    copies = CudaCopies(
        torch.device("cpu"),
        SpanViews([*lay.caches.values(), pool]),
        cuda=cuda,
        find_batch=lambda: (cuda.swap_blocks_batch, ""),
    )
    m = CopyEngineMover(lay.caches, NB, pool, lay.block_dims, copies=copies, page_blocks=2)
    poll = m.poll
    m.poll = lambda h: (cuda.run(), poll(h))[1]  # the GPU runs while the host waits
    before = lay.clone_raw()
    text = round_trip(m, lay.caches, pool, 2)
    gbps = BYTES_PER_S / 1e9
    assert (
        f"store {gbps:.2f} GB/s, load {gbps:.2f} GB/s (CUDA events, one transfer each way" in text
    )
    assert torch.equal(lay.raw[0], before[0])
    # every post: the warm-ups, the timed store and load (one each), the load back page by page
    assert sum("wait_stream compute" in line for line in cuda.log) == 2 + 1 + 1 + 4


def test_host_copy_path_is_refused_for_a_kv_cache_on_a_gpu():
    """A GPU's KV moves on its copy engines: naming a CPU copy path there is
    a configuration error at startup, not a setting silently ignored."""
    from types import SimpleNamespace

    from vllm_kvbm.config.errors import KVBMConfigError

    gpu = SimpleNamespace(is_cuda=True, device="cuda:0")
    with pytest.raises(KVBMConfigError, match=r"host_copy_path: 'threads' .* cuda:0"):
        make_mover({"layer.0": gpu}, NB, None, "UCX", agent_name(), None, 2, "threads")
