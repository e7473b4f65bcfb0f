"""Pages of several engine blocks (config page_tokens): the scheduler keys,
stores and loads whole pages; the worker moves each page's blocks into one
host slot, skipping blocks vLLM's own prefix cache already holds."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from vllm.v1.request import RequestStatus

from helpers.kv_layouts import agent_name, cpu_layout
from helpers.scheduler_harness import BLOCK, block_ids, kvbm, make_request, make_scheduler, step
from helpers.scheduler_harness import keys_of, store_and_finish, tokens
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.engine_info import EngineInfo
from vllm_kvbm.keys import KeyNamespace
from vllm_kvbm.messages import (
    SKIP,
    STREAM,
    KVBMConnectorMetadata,
    KVBMWorkerMetadata,
    TransferJob,
    block_rows,
)
from vllm_kvbm.worker.worker import KVBMWorker
from vllm_kvbm.worker.streaming import StreamedLoad, part

PAGE = 2 * BLOCK  # two blocks a page


def test_a_page_is_stored_whole_and_the_partial_page_is_not():
    s = make_scheduler(page_tokens=PAGE)
    k = kvbm(s)
    prompt = tokens(5 * BLOCK + 8, 1)  # 2 full pages, a fifth block, 8 tokens
    r1 = make_request(prompt, max_tokens=2)
    s.add_request(r1)
    _, meta, _ = step(s)
    (job,) = meta.stores
    assert job.block_ids == block_ids(s, r1.request_id)[:4]  # block 4 is half a page
    assert len(job.slots) == 2 and job.page_blocks == 2
    keys = keys_of(s, prompt)
    assert len(keys) == 2
    step(s, stores_done=[job.job_id])
    assert all(k.host.is_ready(key) for key in keys)
    assert k.stats.total["offload_blocks_d2h"] == 4  # counters stay in blocks
    assert k.stats.gauges["host_cache_capacity_blocks"] == 64  # host_blocks of the harness
    assert k.stats.gauges["host_cache_used_blocks"] == 4


def test_evictions_count_blocks_as_the_host_tiers_capacity_does():
    """Evicted pages count their blocks (kvbm_evicted_blocks_total), in the
    unit of kvbm_cache_capacity_blocks; kvbm_page_size_blocks says a page's."""
    s = make_scheduler(page_tokens=PAGE)
    k = kvbm(s)
    for i in range(18):  # 2 pages each; the harness's 64 blocks hold 32 pages
        store_and_finish(s, tokens(5 * BLOCK + 8, 200 + i))
    assert k.host.evictions > 0
    assert k.stats.total["host_evictions"] == 2 * k.host.evictions
    assert k.stats.gauges["page_size_blocks"] == 2


def stored_pages(base: int):
    """A scheduler with two-block pages that stored a 5-block prompt (2
    pages) and forgot it in vLLM's own cache: (scheduler, its KVBMScheduler,
    the prompt, the pages' slots)."""
    s = make_scheduler(page_tokens=PAGE)
    prompt = tokens(5 * BLOCK + 8, base)
    _, metas = store_and_finish(s, prompt)
    stored = [slot for m in metas for j in m.stores for slot in j.slots]
    assert len(stored) == 2
    assert s.reset_prefix_cache()
    return s, kvbm(s), prompt, stored


def test_pages_load_whole_and_count_blocks():
    s, k, prompt, stored = stored_pages(2)
    r2 = make_request(prompt, max_tokens=1)
    s.add_request(r2)
    _, meta, _ = step(s)
    (load,) = meta.loads
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert load.slots == stored and load.block_ids == block_ids(s, r2.request_id)[:4]
    assert k.stats.total["matched_tokens"] == 2 * PAGE
    assert k.hit_sources(r2, 2 * PAGE) == {"host": 2 * PAGE}
    step(s, finished_recving=[r2.request_id])
    assert k.stats.total["onboard_blocks_h2d"] == 4
    out, meta, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: len(prompt) - 2 * PAGE}
    assert not meta.stores  # the loaded pages are not stored again; block 4 is no page


def test_a_page_that_begins_in_vllms_own_cache_loads_only_its_other_blocks():
    s, k, prompt, stored = stored_pages(3)
    # vLLM caches block 0 alone (a prompt shorter than a page: no KVBM hit).
    store_and_finish(s, prompt[:BLOCK] + tokens(10, 4), max_tokens=1)
    matched = k.stats.total["matched_tokens"]
    r2 = make_request(prompt, max_tokens=1)
    s.add_request(r2)
    _, meta, _ = step(s)
    (load,) = meta.loads
    ids = block_ids(s, r2.request_id)
    # page 0's block 0 is vLLM's (never written), its block 1 and page 1 load
    assert load.slots == stored and load.block_ids == [SKIP] + ids[1:4]
    assert load.num_blocks == 3
    assert block_rows(load) == (ids[1:4], [stored[0] * 2 + 1, stored[1] * 2, stored[1] * 2 + 1])
    assert k.stats.total["matched_tokens"] - matched == 3 * BLOCK
    assert k.hit_sources(r2, 3 * BLOCK) == {"host": 3 * BLOCK}
    step(s, finished_recving=[r2.request_id])
    out, _, _ = step(s)
    assert out.num_scheduled_tokens == {r2.request_id: len(prompt) - 4 * BLOCK}


def test_page_keys_are_vllms_hash_of_each_pages_last_block_and_differ_from_block_keys():
    s1, s2 = make_scheduler(), make_scheduler(page_tokens=PAGE)
    prompt = tokens(4 * BLOCK + 1, 5)
    blocks, pages = keys_of(s1, prompt), keys_of(s2, prompt)
    assert len(blocks) == 4 and len(pages) == 2
    assert not set(blocks) & set(pages)  # another page size: another namespace
    req = make_request(prompt)
    # page i's key is vLLM's hash of block 2i+1, XOR one mask per request
    xor = [
        bytes(a ^ b for a, b in zip(key, req.block_hashes[2 * i + 1]))
        for i, key in enumerate(pages)
    ]
    assert xor[0] == xor[1]


def test_page_tokens_not_a_multiple_of_the_block_size_stops_startup():
    with pytest.raises(KVBMConfigError) as info:
        make_scheduler(page_tokens=BLOCK + 8)
    msg = str(info.value)
    assert msg.startswith("page_tokens: 24 is not a multiple") and f"{BLOCK} tokens" in msg


# ---- the worker: a page's blocks in one host slot, on real NIXL --------------

NB, SLOTS, G = 64, 16, 2


@pytest.fixture
def worker():
    gen = torch.Generator().manual_seed(5)
    lay = cpu_layout(3, NB, heads=2, block_size=4, head_size=16, gen=gen)
    bb = lay.block_bytes()
    ns = KeyNamespace(
        model="pages@",
        dtype="torch.bfloat16",
        kv_layout="NHD",
        block_size=4,
        page_blocks=G,
        page_bytes=bb * G,
        tp_size=1,
    )
    info = EngineInfo(
        block_size=4, block_bytes=bb, num_layers=3, num_workers=1, key_namespace=ns, page_blocks=G
    )
    w = KVBMWorker(info, SLOTS, "UCX", agent_name("kvbm-pages"))
    w.register_kv_caches(lay.caches, NB)
    yield w, lay
    w.shutdown()


def _run(w, meta: KVBMConnectorMetadata, loads: bool) -> KVBMWorkerMetadata:
    (w.start_loads if loads else w.start_stores)(meta)
    total = KVBMWorkerMetadata()
    deadline = time.monotonic() + 10
    want = len(meta.loads) if loads else len(meta.stores)
    recving: set[str] = set()
    while True:
        _, r = w.get_finished(set())
        recving |= r
        m = w.build_worker_meta()
        if m is not None:
            total = total.aggregate(m)
        done = len(recving) if loads else sum(total.stores_done.values())
        if done >= want:
            return total
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_worker_stores_a_page_in_one_slot_and_loads_it_skipping_vllms_blocks(worker):
    w, lay = worker
    assert w.host_pool.shape[1] == G * lay.block_bytes()
    src = [3, 9, 20, 21]  # pages: (3, 9) -> slot 5, (20, 21) -> slot 2
    meta = _run(w, KVBMConnectorMetadata(stores=[TransferJob(1, "A", src, [5, 2])]), False)
    assert meta.stores_done == Counter({1: 1}) and meta.bytes_stored == 4 * lay.block_bytes()
    page = torch.cat([lay.slot_bytes(3), lay.slot_bytes(9)])
    assert torch.equal(w.host_pool[5], page)
    assert torch.equal(w.host_pool[2], torch.cat([lay.slot_bytes(20), lay.slot_bytes(21)]))

    dst = [SKIP, 40, 41, 42]
    # a SKIP taken for a block id would be block -1: the last one
    keep = lay.slot_bytes(NB - 1).clone()
    for b in (40, 41, 42):
        lay.zero_block(b)
    meta = _run(w, KVBMConnectorMetadata(loads=[TransferJob(2, "R", dst, [5, 2])]), True)
    assert meta.bytes_loaded == 3 * lay.block_bytes() and not meta.loads_failed
    assert torch.equal(lay.slot_bytes(40), lay.slot_bytes(9))
    assert torch.equal(lay.slot_bytes(41), lay.slot_bytes(20))
    assert torch.equal(lay.slot_bytes(42), lay.slot_bytes(21))
    assert torch.equal(lay.slot_bytes(NB - 1), keep)


def test_a_streamed_part_takes_each_pages_blocks():
    job = TransferJob(7, "R", [SKIP, 1, 2, 3, 4, 5], [STREAM] * 3)
    load = StreamedLoad(job, fence=None, started=0.0, fetch={0: ("disk", b"a"), 2: ("disk", b"c")})
    sub = part(load, -1, [0, 2], [30, 31])
    assert sub.block_ids == [SKIP, 1, 4, 5] and sub.slots == [30, 31]
    assert sub.fetch == [(0, "disk", b"a"), (1, "disk", b"c")]


def test_the_default_page_is_256_tokens_for_small_blocks_and_one_block_from_128():
    from vllm_kvbm.engine_info import _page_blocks

    assert kvbm(make_scheduler(page_tokens=None)).info.page_tokens == 256  # BLOCK 16
    assert [_page_blocks(None, b) for b in (16, 32, 48, 64, 128, 256)] == [16, 8, 6, 4, 1, 1]
    assert _page_blocks(96, 32) == 3
