"""Per-tier hit sources in vLLM's own metrics, on vLLM's real Scheduler.

vLLM asks the connector which tier supplied each admitted external hit
(get_external_cache_hit_sources) and records the split in the scheduler
stats it hands its stat loggers (connector_prefix_cache_stats.hits_by_source,
exported as vllm:prompt_tokens_cached_by_source{source=...}). The pages are
real: host-tier blocks stored through a finished request, a disk page written
by the worker's DiskStore, a remote page put on a real LMCache server.
"""

from __future__ import annotations

import time

import pytest
import torch
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from helpers.tier_pages import disk_store_for, tier_of
from helpers.scheduler_harness import BLOCK, kvbm, make_request, make_scheduler, step
from helpers.scheduler_harness import keys_of, store_and_finish, tokens


def _wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _finish(sched, req) -> None:
    """Steps with a worker that completes every transfer until ``req`` is done
    (its load, planned in the step that admitted it, first)."""
    loading = [req.request_id] if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS else []
    deadline = time.monotonic() + 30
    while req.request_id in sched.requests:
        assert time.monotonic() < deadline, f"{req.request_id} did not finish"
        step(sched, complete=True, finished_recving=loading)
        loading = []
        time.sleep(0.002)


def _admit(sched, prompt):
    """Submits ``prompt``; returns the request and the connector prefix-cache
    stats vLLM reports for the step that admitted it."""
    req, scheduler_stats = _admit_step(sched, prompt)
    return req, scheduler_stats.connector_prefix_cache_stats


def _admit_step(sched, prompt):
    """Submits ``prompt``; returns the request and vLLM's scheduler stats of
    the step that admitted it."""
    req = make_request(prompt, max_tokens=2)
    sched.add_request(req)
    # With a lower tier, the first lookup is answered in the
    # background: vLLM asks again each step until the answer is there.
    deadline = time.monotonic() + 10
    while True:
        _, _, engine_outputs = step(sched)
        if req.status != RequestStatus.WAITING:
            break
        assert time.monotonic() < deadline, "the request was never admitted"
        time.sleep(0.01)
    return req, engine_outputs[0].scheduler_stats


def test_host_hit_is_labelled_host():
    sched = make_scheduler(host_blocks=16)
    prompt = tokens(3 * BLOCK + 5, 21)
    store_and_finish(sched, prompt)
    assert sched.reset_prefix_cache()  # vLLM forgets; the host tier does not

    req, stats = _admit(sched, prompt)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert stats.hits == 3 * BLOCK
    assert stats.hits_by_source == {CacheHitSource.HOST: 3 * BLOCK}
    _finish(sched, req)


def test_miss_reports_no_source():
    sched = make_scheduler(host_blocks=16)
    req, stats = _admit(sched, tokens(2 * BLOCK + 3, 22))
    assert stats.queries == 2 * BLOCK + 3 and stats.hits == 0
    assert stats.hits_by_source == {}
    _finish(sched, req)


def test_host_disk_and_remote_hits_split_in_vllm_stats(tmp_path, lm_server):
    from vllm_kvbm.tiers.lm.store import RemoteStore

    sched = make_scheduler(
        host_blocks=16,
        disk_cache_dir=str(tmp_path),
        disk_cache_size="64MiB",
        remote_url=lm_server.url,
    )
    k = kvbm(sched)
    prompt = tokens(4 * BLOCK + 5, 23)
    keys = keys_of(sched, prompt)
    # Blocks 0-1 in the host tier (no disk or remote copy: the spills the
    # finished request asked for are never carried out by this fake worker).
    store_and_finish(sched, prompt[: 2 * BLOCK + 1])
    assert sched.reset_prefix_cache()
    assert all(k.host.is_ready(key) for key in keys[:2])
    # Block 2 on disk, block 3 on the remote server, written as the worker would.
    page = torch.zeros(k.info.block_bytes, dtype=torch.uint8)
    disk = disk_store_for(k, tmp_path)
    remote = RemoteStore(
        lm_server.url, k.info.block_bytes, k.info.tier_namespace, 0, 1, timeout_s=5.0
    )
    try:
        assert disk.put(keys[2], page)
        assert remote.put(keys[3], page)
        _wait_until(lambda: tier_of(k.lower, keys[2]) == "disk", "disk page never visible")
        _wait_until(lambda: tier_of(k.lower, keys[3]) == "remote", "remote page never visible")
        before = dict(k.stats.total)

        req, stats = _admit(sched, prompt)
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    finally:
        disk.close()
        remote.close()
    assert stats.requests == 1 and stats.hits == 4 * BLOCK
    assert stats.queries == 4 * BLOCK + 5
    # vLLM's own split: what vllm:prompt_tokens_cached_by_source{source} adds.
    assert stats.hits_by_source == {
        CacheHitSource.HOST: 2 * BLOCK,
        CacheHitSource.DISK: BLOCK,
        CacheHitSource.EXTERNAL_UNSPECIFIED: BLOCK,
    }
    # ...and KVBM's own per-tier counters agree with it.
    for tier, blocks in (("host", 2), ("disk", 1), ("remote", 1)):
        name = f"matched_tokens_{tier}"
        assert k.stats.total[name] - before.get(name, 0) == blocks * BLOCK, tier


def test_vllm_prometheus_counter_gets_the_split(tmp_path):
    """The split reaches vllm:prompt_tokens_cached_by_source through vLLM's
    own Prometheus stat logger."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    sched = make_scheduler(host_blocks=16, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    prompt = tokens(3 * BLOCK + 2, 24)
    keys = keys_of(sched, prompt)
    store_and_finish(sched, prompt[: BLOCK + 1])
    assert sched.reset_prefix_cache()
    disk = disk_store_for(k, tmp_path)
    try:
        page = torch.zeros(k.info.block_bytes, dtype=torch.uint8)
        assert disk.put(keys[1], page) and disk.put(keys[2], page)
        _wait_until(lambda: tier_of(k.lower, keys[2]) == "disk", "disk pages never visible")
    finally:
        disk.close()

    prom = PrometheusStatLogger(sched.vllm_config, engine_indexes=[0])
    labels = {"model_name": sched.vllm_config.model_config.served_model_name, "engine": "0"}

    def cached(source: str) -> float:
        value = REGISTRY.get_sample_value(
            "vllm:prompt_tokens_cached_by_source_total", {**labels, "source": source}
        )
        assert value is not None, f"no vllm:prompt_tokens_cached_by_source{{source={source}}}"
        return value

    before = {s: cached(s) for s in ("host", "disk", "external_unspecified")}
    req, scheduler_stats = _admit_step(sched, prompt)
    prom.record(scheduler_stats=scheduler_stats, iteration_stats=None, engine_idx=0)
    assert cached("host") - before["host"] == BLOCK
    assert cached("disk") - before["disk"] == 2 * BLOCK
    assert cached("external_unspecified") == before["external_unspecified"]
    _finish(sched, req)


def test_may_load_async_guesses_from_the_first_block(tmp_path):
    """vLLM 0.34 asks this when a request is queued; on 0.32 it is called here
    directly, on the real connector."""
    sched = make_scheduler(host_blocks=16, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(sched)
    stored = tokens(2 * BLOCK + 1, 25)
    store_and_finish(sched, stored)
    on_disk = tokens(2 * BLOCK + 1, 26)
    disk = disk_store_for(k, tmp_path)
    try:
        assert disk.put(
            keys_of(sched, on_disk)[0], torch.zeros(k.info.block_bytes, dtype=torch.uint8)
        )
        _wait_until(
            lambda: tier_of(k.lower, keys_of(sched, on_disk)[0]) == "disk",
            "disk page never visible",
        )
    finally:
        disk.close()
    connector = sched.connector
    assert connector.may_load_async(make_request(stored + [5, 6]))
    # A page only a lower tier holds: the lookup thread is asked (no stat on
    # vLLM's thread), and the guess is True once it answered.
    queued = make_request(on_disk)
    _wait_until(lambda: connector.may_load_async(queued), "the disk page never guessed")
    assert not connector.may_load_async(make_request(tokens(2 * BLOCK + 1, 27)))
    assert not connector.may_load_async(make_request(stored[:BLOCK]))  # no full block to load


def test_vllm_starts_a_hit_load_while_the_batch_is_full():
    """vLLM >= 0.34 with --max-num-inflight-kv-loads: a request may_load_async
    says True for waits in vLLM's async-load queue and starts its load while the
    running batch is full; a miss waits for a running slot. (Runs on 0.34 through
    test_vllm_compat's run of this file on each supported release.)"""
    sched = make_scheduler(host_blocks=16, max_num_seqs=1)
    if not hasattr(sched, "async_kv_waiting"):
        pytest.skip("this vLLM has no --max-num-inflight-kv-loads (added in 0.34)")
    stored = tokens(2 * BLOCK + 3, 31)
    store_and_finish(sched, stored)
    assert sched.reset_prefix_cache()
    sched.scheduler_config.max_num_inflight_kv_loads = 2
    running = make_request(tokens(BLOCK + 1, 32), max_tokens=30)
    sched.add_request(running)
    step(sched, complete=True)
    assert running.status == RequestStatus.RUNNING  # the one running slot is taken

    hit, miss = make_request(stored, max_tokens=2), make_request(tokens(2 * BLOCK + 3, 33))
    sched.add_request(hit)
    sched.add_request(miss)
    assert len(sched.async_kv_waiting) == 1 and len(sched.waiting) == 1
    _, meta, _ = step(sched, complete=True)
    assert running.status == RequestStatus.RUNNING
    assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # loading meanwhile
    assert [job.req_id for job in meta.loads] == [hit.request_id]
    assert miss.status == RequestStatus.WAITING
    for _ in range(100):  # the load was reported done above: the rest just runs
        if not sched.requests:
            break
        step(sched, complete=True)
    assert not sched.requests
