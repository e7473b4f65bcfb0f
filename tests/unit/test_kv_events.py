"""KV events for routers (scheduler/kv_events.py) through vLLM's real
Scheduler with a real ZMQ event publisher: every batch the scheduler
publishes is recorded on its way to the socket, and the connector's events
(mediums CPU, DISK) are checked against the connector's counters and the
requests' own vLLM block hashes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from helpers.scheduler_harness import (
    BLOCK,
    admit,
    kvbm,
    make_request,
    make_scheduler,
    step,
    step_with_weights,
    store_and_finish,
    tokens,
    worker_output,
    worker_weights,
)
from vllm_kvbm.scheduler.kv_events import KVEvents
from vllm_kvbm.scheduler.slot_index import SlotIndex
from vllm_kvbm.worker.loaded_weights import LoadedWeights
from vllm_kvbm.tools.server import free_port


def events_scheduler(**kwargs):
    """A scheduler publishing KV events on a real ZMQ PUB socket; returns it
    and the list its published batches are recorded in."""
    sched = make_scheduler(
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
        },
        **kwargs,
    )
    published = []
    publish = sched.kv_event_publisher.publish

    def record(batch):
        published.append(batch)
        publish(batch)

    sched.kv_event_publisher.publish = record
    return sched, published


@pytest.fixture
def closing():
    scheds = []
    yield scheds.append
    for sched in scheds:
        sched.shutdown()


def tier_events(published, medium: str) -> tuple[list, list, list]:
    """(stored events, stored hashes, removed hashes) with ``medium``, in order."""
    stored = [
        e for b in published for e in b.events if isinstance(e, BlockStored) and e.medium == medium
    ]
    removed = [
        h
        for b in published
        for e in b.events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]
    return stored, [h for e in stored for h in e.block_hashes], removed


def external(req, blocks: slice) -> list:
    return [maybe_convert_block_hash(h) for h in req.block_hashes[blocks]]


def test_host_stores_and_evictions_are_published_as_vllm_names_the_blocks(closing):
    sched, published = events_scheduler(host_blocks=4)
    closing(sched)
    k = kvbm(sched)
    a, _ = store_and_finish(sched, tokens(3 * BLOCK + 5, 1))
    events, stored, removed = tier_events(published, "CPU")
    assert stored == external(a, slice(0, 3)) and removed == []
    assert len(stored) == k.stats.total["offload_blocks_d2h"] == 3
    first = events[0]
    assert first.parent_block_hash is None and first.block_size == BLOCK
    assert first.token_ids == list(a.all_token_ids[: len(first.block_hashes) * BLOCK])
    assert first.lora_id is None and first.lora_name is None
    # vLLM's own events for the same blocks name them alike (medium GPU)
    gpu = [
        h
        for b in published
        for e in b.events
        if isinstance(e, BlockStored) and e.medium == "GPU"
        for h in e.block_hashes
    ]
    assert set(stored) <= set(gpu)

    # Three more blocks into four slots: a's two least recently used go.
    b, _ = store_and_finish(sched, tokens(3 * BLOCK + 5, 2))
    _, stored, removed = tier_events(published, "CPU")
    assert stored == external(a, slice(0, 3)) + external(b, slice(0, 3))
    assert len(stored) == k.stats.total["offload_blocks_d2h"] == 6
    assert removed == external(a, slice(0, 2))
    assert len(removed) == k.stats.total["host_evictions"] == 2


def test_a_cache_reset_publishes_every_host_page_removed(closing):
    sched, published = events_scheduler(host_blocks=8)
    closing(sched)
    a, _ = store_and_finish(sched, tokens(3 * BLOCK + 5, 3))
    assert sched.reset_prefix_cache(reset_connector=True)
    step(sched)  # events go out with the next step's batch
    _, stored, removed = tier_events(published, "CPU")
    assert removed == stored == external(a, slice(0, 3))
    # a second store after the reset is announced afresh
    store_and_finish(sched, tokens(2 * BLOCK + 5, 4))
    _, stored, _ = tier_events(published, "CPU")
    assert len(stored) == kvbm(sched).stats.total["offload_blocks_d2h"] == 5


def test_pages_not_covered_by_vllm_block_hashes_publish_nothing():
    """A request without vLLM block hashes (vLLM's prefix caching off), or
    whose hashes end before a page, publishes nothing for it, in any tier."""
    events = KVEvents(BLOCK, 1, num_workers=1)
    host = SlotIndex(8)
    events.watch(host)
    bare = make_request(tokens(2 * BLOCK + 1, 5), block_hasher=None)
    hashed = make_request(tokens(2 * BLOCK + 1, 6))
    keys = [b"a0", b"a1", b"b0", b"b1", b"b2"]
    host.allocate_missing(keys, 0, 5)
    events.describe(bare, keys[:2], [0, 1])
    events.describe(hashed, keys[2:], [0, 1, 2])
    host.commit(keys)
    events.spilling(["disk"], keys)
    events.lower_stored([("disk", key) for key in keys])
    assert [h for e in events.take() for h in e.block_hashes] == (
        2 * external(hashed, slice(0, 2))
    )  # host, then disk; b2 is past its hashes
    for key in keys:
        host.drop(key)
    [removed] = events.take()
    assert removed.medium == "CPU" and removed.block_hashes == external(hashed, slice(0, 2))


def test_no_kv_events_config_publishes_nothing_and_costs_no_state():
    sched = make_scheduler(host_blocks=8)
    k = kvbm(sched)
    assert not k.events.enabled and k.host.on_ready is None
    store_and_finish(sched, tokens(2 * BLOCK + 5, 6))
    assert list(sched.connector.take_events()) == []


def step_reporting(sched, **worker_meta):
    """One step whose worker also reports ``worker_meta`` fields
    (tier_stored, tier_events, removed_pages, spills_done counts)."""
    out = sched.schedule()
    mro = worker_output(sched, out)
    meta = mro.kv_connector_output.kv_connector_worker_meta
    for name, value in worker_meta.items():
        field = getattr(meta, name)
        if isinstance(field, Counter):
            field.update(value)
        else:
            field.extend(value)
    sched.update_from_output(out, mro)
    return out.kv_connector_metadata


def test_disk_write_through_is_published_when_confirmed_and_removed_when_lost(closing, tmp_path):
    sched, published = events_scheduler(
        host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB"
    )
    closing(sched)
    k = kvbm(sched)
    req = make_request(tokens(2 * BLOCK + 3, 7), max_tokens=2)
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    [job] = meta.stores
    step(sched, stores_done=[job.job_id])
    meta = step_reporting(sched)
    [spill] = meta.spills
    assert spill.tiers == ["disk"]
    assert tier_events(published, "DISK") == ([], [], [])  # written, not yet confirmed
    written = [("disk", key) for key in spill.keys]
    step_reporting(
        sched,
        spills_done={spill.job_id: 1},
        tier_stored=written,
        tier_events={("disk", "stored", 0): len(written)},
    )
    _, stored, removed = tier_events(published, "DISK")
    assert stored == external(req, slice(0, 2)) and removed == []
    assert len(stored) == k.stats.total["offload_blocks_h2d"] == 2
    # The disk deleted the first page on its own (its LRU): removed there only.
    step_reporting(sched, removed_pages=[written[0]])
    _, _, removed = tier_events(published, "DISK")
    assert removed == external(req, slice(0, 1))
    assert tier_events(published, "CPU")[2] == []
    # (it finished while its store was in flight: its blocks wait for that)
    step(sched, finished_sending=[req.request_id])
    assert req.request_id not in sched.requests
    # A connector reset under the same weights: the disk's page is served
    # again, so it stays announced.
    assert sched.reset_prefix_cache(reset_connector=True)
    step_with_weights(sched, [worker_weights(torch.nn.Linear(2, 2))])  # as loaded
    _, _, removed = tier_events(published, "DISK")
    assert removed == external(req, slice(0, 1))
    # Other weights (the workers report another digest): the keys move, and
    # no page from before is looked up again here.
    assert sched.reset_prefix_cache()
    step_with_weights(sched, [LoadedWeights(0, None)])  # a new label each epoch
    step(sched)
    _, _, removed = tier_events(published, "DISK")
    assert removed == external(req, slice(0, 2))


def test_a_page_of_several_blocks_names_each_block_and_waits_for_every_worker():
    """Pages of two blocks, two TP workers: the disk page is announced once
    both workers wrote their shard; the lower-tier table is bounded (the
    oldest page is announced removed past it)."""
    events = KVEvents(BLOCK, 2, num_workers=2, lower_pages=1)
    host = SlotIndex(4)
    events.watch(host)
    req = make_request(tokens(4 * BLOCK + 1, 8))
    keys = [b"p0", b"p1"]
    _, _, _ = host.allocate_missing(keys, 0, 2)
    events.describe(req, keys, [0, 1])
    host.commit(keys)
    [stored] = events.take()  # the second page continues the first: one event
    assert stored.medium == "CPU" and stored.block_hashes == external(req, slice(0, 4))
    assert stored.token_ids == list(req.all_token_ids[: 4 * BLOCK])
    events.spilling(["disk"], keys)
    events.lower_stored([("disk", b"p0"), ("disk", b"p1")])
    assert events.take() == []  # one worker of two
    events.lower_stored([("disk", b"p0")])
    [disk0] = events.take()
    assert disk0.medium == "DISK" and disk0.block_hashes == external(req, slice(0, 2))
    assert disk0.parent_block_hash is None
    events.lower_stored([("disk", b"p1")])
    disk1, dropped = events.take()  # past the table's bound: p0 announced removed
    assert disk1.block_hashes == external(req, slice(2, 4))
    assert disk1.parent_block_hash == external(req, slice(1, 2))[0]
    assert isinstance(dropped, BlockRemoved) and dropped.block_hashes == external(req, slice(0, 2))
    host.drop(b"p1")
    [gone] = events.take()
    assert gone.medium == "CPU" and gone.block_hashes == external(req, slice(2, 4))


def test_pool_pages_served_to_peers_name_their_holder_as_ownership():
    """A pool page's events carry the endpoint peers read it at (vLLM's
    ``ownership``) once the workers said it; host and disk pages carry none."""
    endpoint = "tcp://10.0.0.7:7300"
    events = KVEvents(BLOCK, 1, num_workers=1)
    host = SlotIndex(4)
    events.watch(host)
    req = make_request(tokens(3 * BLOCK + 1, 9))
    keys = [b"p0", b"p1", b"p2"]
    host.allocate_missing(keys, 0, 3)
    events.describe(req, keys, [0, 1, 2])
    host.commit(keys)
    [stored] = events.take()
    assert stored.medium == "CPU" and stored.ownership is None
    events.spilling(["pool", "disk"], keys)
    events.lower_stored([("pool", b"p0")])  # before the workers said where: no owner
    [first] = events.take()
    assert first.medium == "CPU" and first.ownership is None
    events.pool_owner = endpoint
    events.lower_stored([("pool", b"p1"), ("pool", b"p2"), ("disk", b"p0")])
    pool, disk = events.take()  # the owner changed: not merged into the first event
    assert pool.medium == "CPU" and pool.ownership == endpoint
    assert pool.block_hashes == external(req, slice(1, 3))
    assert disk.medium == "DISK" and disk.ownership is None
    events.lower_removed("pool", b"p1")
    events.lower_removed("pool", b"p0")  # (announced before the workers said: now named)
    [gone] = events.take()
    assert gone.medium == "CPU" and gone.ownership == endpoint
    assert gone.block_hashes == external(req, slice(1, 2)) + external(req, slice(0, 1))
