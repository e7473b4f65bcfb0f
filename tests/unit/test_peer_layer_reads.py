"""Peer hits read layer by layer during the forward pass (tiers/peer/page_layers.py,
worker/layer_reads.py), with real NIXL agents in real processes.

As in test_peer_reads, the serving peer is helpers/pool_peer.py and this
process writes its pool file (shared memory). A peer's pages read a byte
range at a time into registered host slots land byte for byte as the pages
lie in the peer's pool, checked as they go (the pages are sealed under a
page secret: decrypted range by range); a damaged page is "corrupt", a slot
rewritten between the first and last READ a miss (the seqlock). Through the
worker: each layer's blocks hold the page's bytes once vLLM's wait for it
returns; a peer stopped (SIGSTOP) after the headers were read stalls a
range's READ over TCP: the step fails at its deadline, the host slots that
READ may write stay held until it ends (after SIGCONT), and layered reads
pause until then; a peer killed mid-read fails the step, never a hang, and
pauses layered reads too.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from helpers import pool_peer
from helpers.scheduler_harness import (
    BLOCK,
    keys_of,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    step,
    tokens,
)
from helpers.tier_pages import key, page
from test_layer_loads import run_step, worker_with_layer_copies
from test_layer_reads import released_and_back
from test_page_mover import make_layout
from test_peer_reads import NS, SECRET, TRANSPORTS, transport  # noqa: F401
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.peer import page_layers, protocol
from vllm_kvbm.tiers.peer.agent import NixlCallError
from vllm_kvbm.tiers.peer.store import PeerStore
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.store import PoolStore
from vllm_kvbm.tools.server import free_port, freeze_process
from vllm_kvbm.worker import layer_reads

pytestmark = pytest.mark.timeout(300)

PAGE = 3 * 4096 + 1000  # ranges across 4 KiB boundaries, one not aligned
RANGES = [(0, 5000), (5000, 4000), (9000, 4288)]


def codec(page_bytes: int) -> PageCodec:
    return PageCodec(NS, page_bytes, SECRET, layout="L")


def peer(shm, procs, page_bytes: int, pages: int, transport_env: dict):
    """(this process's store on the peer's pool file, the peer's endpoint, its process)."""
    port = free_port()
    w = PoolStore.open(pool_peer.pool_spec(shm, page_bytes, pages, NS), codec(page_bytes))
    proc, _ = pool_peer.start(shm, port, page_bytes, pages, env=transport_env)
    procs.append(proc)
    return w, f"tcp://127.0.0.1:{port}", proc


def reader(page_bytes: int, **kw) -> PeerStore:
    spec = pool_peer.pool_spec("/nonexistent", page_bytes, 1, NS)
    kw.setdefault("read_timeout_s", 5.0)
    kw.setdefault("retry_s", 0.2)
    return PeerStore(codec(page_bytes), 0, 1, spec.scope_digest, spec.name, **kw)


def read_by_ranges(r: PeerStore, items, endpoint: str, ranges, between=None) -> list[str]:
    """One layered read of ``items``: its statuses (``between()`` after the
    first ranges' READs, before the last)."""
    group = r.open_layers(items, endpoint, ranges, time.monotonic() + 10.0)
    if isinstance(group, str):
        return [group] * len(items)
    try:
        if group.start():
            for k in range(len(ranges)):
                if k == len(ranges) - 1 and between is not None:
                    between()
                if not group.read(k):
                    break
            else:
                group.finish()
        return group.statuses
    finally:
        assert group.close() == []


def test_a_peers_pages_read_range_by_range_land_whole_and_checked(shm, procs, transport):
    w, endpoint, _ = peer(shm, procs, PAGE, 8, TRANSPORTS[transport])
    r = reader(PAGE)
    host = torch.zeros(5, PAGE, dtype=torch.uint8)
    try:
        r.reads_into(host)
        for i in range(1, 5):
            assert w.put(key(i), page(i, PAGE))
        items = [(key(i), host[i - 1]) for i in range(1, 5)]
        assert r.get_many_into(items[:1], endpoint=endpoint) == ["ok"]  # connected
        host.zero_()
        assert read_by_ranges(r, items, endpoint, RANGES) == ["ok"] * 4
        assert all(torch.equal(host[i - 1], page(i, PAGE)) for i in range(1, 5))
        assert r.heads.free == page_layers.HEADER_SLOTS and r.quarantined == 0
        # a page the peer no longer holds: decided before any range
        assert read_by_ranges(r, items + [(key(7), host[4])], endpoint, RANGES)[-1] == "miss"
        # damaged in the peer's pool, in the last range: "corrupt" at the end
        slot, _ = layout.find(
            w.pool.view, w.pool.geometry, layout.table_key(w._codec.names, key(2))
        )
        w.pool.view[w.pool.geometry.slot_off(slot) + w.pool.geometry.stored_bytes - 1] ^= 0x01
        assert read_by_ranges(r, items, endpoint, RANGES) == ["ok", "corrupt", "ok", "ok"]
        # the slot rewritten (the same key, another page) after its entry was
        # read: a miss by the seqlock, whatever the ranges held
        torn = r.torn_reads

        def rewrite():
            w.remove(key(3))
            assert w.put(key(3), page(30, PAGE))

        got = read_by_ranges(r, items, endpoint, RANGES, between=rewrite)
        assert got[2] == "miss" and r.torn_reads == torn + 1
        assert r.heads.free == page_layers.HEADER_SLOTS
        # a host slot not registered with the store: refused, not read around
        assert r.open_layers([(key(1), torch.zeros(PAGE, dtype=torch.uint8))], endpoint,
                             RANGES, time.monotonic() + 5) == "error"  # fmt: skip
    finally:
        r.close()
        w.close()


def test_batches_wait_while_a_layered_read_is_open(shm, procs):
    """The store's lock serves the whole-page batches of loads before the
    step and the layered reads a step waits for: a batch asked while a
    layered read is open waits for it to close, not the other way round."""
    w, endpoint, _ = peer(shm, procs, PAGE, 8, TRANSPORTS["tcp"])
    r = reader(PAGE)
    host = torch.zeros(2, PAGE, dtype=torch.uint8)
    try:
        r.reads_into(host)
        assert w.put(key(1), page(1, PAGE)) and w.put(key(2), page(2, PAGE))
        assert r.get_many_into([(key(1), host[0])], endpoint=endpoint) == ["ok"]
        group = r.open_layers([(key(2), host[1])], endpoint, RANGES, time.monotonic() + 10)
        assert group.start()
        done: list = []
        batch = threading.Thread(
            target=lambda: done.append(r.get_many_into([(key(1), host[0])], endpoint=endpoint))
        )
        batch.start()
        time.sleep(0.3)
        assert not done  # waiting for the layered read
        assert all(group.read(k) for k in range(len(RANGES)))
        group.finish()
        assert group.statuses == ["ok"] and torch.equal(host[1], page(2, PAGE))
        assert group.close() == []
        batch.join(10)
        assert done == [["ok"]] and r.layered_open == 0
    finally:
        r.close()
        w.close()


def test_a_peer_slow_to_answer_holds_up_no_other_peers_read(shm, procs):
    """A hello out to a peer that does not answer (stopped, its network
    gone) lets go of the store's lock for its round trip: a layered read of
    another peer, which its step waits for, goes on meanwhile, not after
    the hello's timeout."""
    import zmq

    w, endpoint, _ = peer(shm, procs, PAGE, 8, TRANSPORTS["tcp"])
    r = reader(PAGE, read_timeout_s=60.0)  # the hello is out until answered below
    host = torch.zeros(2, PAGE, dtype=torch.uint8)
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # takes requests, answers once told to
    mute.setsockopt(zmq.LINGER, 0)
    port = free_port()
    mute.bind(f"tcp://127.0.0.1:{port}")
    asked: list = []
    try:
        r.reads_into(host)
        assert w.put(key(1), page(1, PAGE))
        assert r.get_many_into([(key(1), host[0])], endpoint=endpoint) == ["ok"]  # connected
        hello = threading.Thread(
            target=lambda: asked.append(
                r.get_many_into([(key(1), host[1])], endpoint=f"tcp://127.0.0.1:{port}")
            )
        )
        hello.start()
        assert mute.poll(10_000)  # the hello is out
        host[0].zero_()
        assert read_by_ranges(r, [(key(1), host[0])], endpoint, RANGES) == ["ok"]
        assert hello.is_alive() and not asked  # read while the hello was still out
        assert torch.equal(host[0], page(1, PAGE))
        ident, empty, *frames = mute.recv_multipart()
        request, _ = protocol.decode(frames)
        answer = {"ok": False, "error": "not this pool", "id": request["id"]}
        mute.send_multipart([ident, empty, *protocol.encode(answer)])
        hello.join(15)
        assert asked == [["error"]]  # a refusal: its pages recomputed
    finally:
        r.close()
        w.close()
        mute.close()
        ctx.term()


def worker_with_peer(shm, procs, lay, monkeypatch, transport_env):
    worker = worker_with_layer_copies(lay, monkeypatch)
    w, endpoint, proc = peer(shm, procs, lay.block_bytes(), 16, transport_env)
    store = reader(lay.block_bytes())
    worker.add_tier(store)
    first = worker.build_worker_meta()
    assert first is not None and first.layered_read_workers == 1
    deadline = time.monotonic() + 10
    while not store.reads_in_place:  # the host tier registered on the tier's read thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.get_finished(set())
    assert worker.build_worker_meta().layered_peer_workers == 1  # said once
    worker.get_finished(set())
    again = worker.build_worker_meta()
    assert again is None or again.layered_peer_workers == 0
    return worker, store, w, endpoint, proc


def test_peers_not_read_in_place_are_not_read_by_layer(monkeypatch):
    """A peer tier that could not register the host tier's slots with its
    NIXL agent (NIXL refused: memory-lock limits, an RDMA device's) reads
    through landing slots; the worker never tells the scheduler it reads
    peers layer by layer, so such hits load before their step."""
    lay = make_layout("cpu", torch.Generator().manual_seed(35))
    worker = worker_with_layer_copies(lay, monkeypatch)
    store = reader(lay.block_bytes())

    def refuse(addr, n):
        raise NixlCallError("registering memory: NIXL_ERR_BACKEND")

    monkeypatch.setattr(store._agent, "register", refuse)
    try:
        worker.add_tier(store)
        assert worker.build_worker_meta().layered_read_workers == 1  # disk hits would be
        worker.tier_io._reader["peer"].submit(lambda: None).result(10)  # reads_into ran
        assert not store.reads_in_place
        worker.get_finished(set())
        meta = worker.build_worker_meta()
        assert meta is None or meta.layered_peer_workers == 0  # peers before the step
    finally:
        worker.shutdown()


def peer_job(job_id, req, blocks, slots, keys, endpoint) -> TransferJob:
    fetch = [(i, "peer", k) for i, k in enumerate(keys)]
    return TransferJob(job_id, req, blocks, slots, layered=True, fetch=fetch, peer=endpoint)


def test_a_peer_hit_is_read_and_copied_layer_by_layer_in_its_step(shm, procs, monkeypatch):
    gen = torch.Generator().manual_seed(31)
    lay = make_layout("cpu", gen)
    worker, store, w, endpoint, _ = worker_with_peer(
        shm, procs, lay, monkeypatch, TRANSPORTS["tcp"]
    )
    try:
        pages = [page(40 + i, lay.block_bytes()) for i in range(3)]
        for i, p in enumerate(pages):
            assert w.put(key(i), p)
        job = peer_job(1, "A", [4, 9, 11], [0, 1, 2], [key(0), key(1), key(2)], endpoint)
        recving, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        assert recving == set() and errors == set()
        assert meta.loads_done["A"] == 1 and not meta.loads_failed
        assert meta.tier_events[("peer", "ok", 0)] == 3 and not meta.bad_pages
        for block, slot, p in zip([4, 9, 11], [0, 1, 2], pages):
            assert torch.equal(lay.slot_bytes(block), p)
            assert torch.equal(worker.host_pool[slot], p)  # promoted: in the host tier now
        # a page gone from the peer since the lookup: the step's loads fail
        job = peer_job(2, "B", [5, 6], [3, 4], [key(0), key(9)], endpoint)
        _, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        assert errors == {5, 6} and meta.loads_failed["B"] == 1
        assert meta.tier_events[("peer", "miss", 0)] == 1
        assert meta.layered_read_workers == 0  # a miss is no reason to stop
        # a page damaged in the peer's pool, found at its last layer: its own
        # request's load fails; the other peer hit and the host hit keep theirs
        for i in (5, 6):
            assert w.put(key(i), page(40 + i, lay.block_bytes()))
        g = w.pool.geometry
        slot, _ = layout.find(w.pool.view, g, layout.table_key(w._codec.names, key(6)))
        w.pool.view[g.slot_off(slot) + g.stored_bytes - 1] ^= 0x01
        good = peer_job(3, "C", [12], [5], [key(5)], endpoint)
        bad = peer_job(4, "D", [13], [6], [key(6)], endpoint)
        host = TransferJob(5, "E", [14], [0], layered=True)
        loads = KVBMConnectorMetadata(loads=[good, bad, host])
        _, meta, errors = run_step(worker, loads, lay.caches)
        assert errors == {13} and dict(meta.loads_failed) == {"D": 1}
        assert meta.bad_pages == [("peer", key(6))]
        assert torch.equal(lay.slot_bytes(12), page(45, lay.block_bytes()))
        assert torch.equal(lay.slot_bytes(14), pages[0])
    finally:
        worker.shutdown()
        w.close()


def connected_then(shm, procs, monkeypatch, seed: int, fault):
    """A worker reading a peer over TCP that holds key(0), connected by a
    first layered read; from then on ``fault(peer process)`` runs as soon as
    a layered read has the pages' headers. (layout, worker, store, the
    peer's pool, its endpoint, its process)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    lay = make_layout("cpu", torch.Generator().manual_seed(seed))
    worker, store, w, endpoint, proc = worker_with_peer(
        shm, procs, lay, monkeypatch, TRANSPORTS["tcp"]
    )
    try:
        assert w.put(key(0), page(seed, lay.block_bytes()))
        warm = peer_job(1, "W", [2], [6], [key(0)], endpoint)
        assert run_step(worker, KVBMConnectorMetadata(loads=[warm]), lay.caches)[2] == set()
    except BaseException:
        worker.shutdown()
        w.close()
        raise
    start = page_layers.PeerPageLayers.start

    def start_then_fault(self):
        ok = start(self)
        fault(proc)
        return ok

    monkeypatch.setattr(page_layers.PeerPageLayers, "start", start_then_fault)
    return lay, worker, store, w, endpoint, proc


def test_a_peer_stopped_mid_read_fails_the_step_and_holds_slots_until_its_read_ends(
    shm, procs, monkeypatch
):
    """Over TCP a stopped peer stalls a range's READ past the step's
    deadline: the step fails at the deadline; the READ's host slots stay
    held until NIXL ends it (after SIGCONT), and layered reads come back."""
    monkeypatch.setattr(layer_reads, "READ_WAIT_MIN_S", 0.5)
    monkeypatch.setattr(layer_reads, "READS_BACK_AFTER_S", 0.0)
    # the headers read, the ranges' READs stall
    lay, worker, store, w, endpoint, proc = connected_then(
        shm, procs, monkeypatch, 32, lambda proc: freeze_process(proc, "the peer")
    )
    try:
        job = peer_job(2, "A", [3], [4], [key(0)], endpoint)
        before = lay.clone_raw()
        began = time.monotonic()
        _, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        assert time.monotonic() - began < 5  # the deadline, not the stopped peer
        assert errors == {3} and meta.loads_failed["A"] == 1
        assert meta.slots_held == {4: 1} and meta.layered_read_workers == -1
        assert meta.tier_events[("peer", "error", 0)] == 1
        settle = time.monotonic() + 5  # the read thread gives up at the same deadline
        while not store.quarantined and time.monotonic() < settle:
            time.sleep(0.01)
        assert store.quarantined == 1  # its header landing slot, until the READ ends
        time.sleep(0.5)
        worker.get_finished(set())
        meta = worker.build_worker_meta()
        assert meta is None or not meta.slots_released  # stopped: the READ cannot end
        os.killpg(proc.pid, signal.SIGCONT)
        assert released_and_back(worker, 4) == (1, 1)  # slots free once the READ ended
        assert store.quarantined == 0
        assert torch.equal(lay.slot_bytes(3), lay.slot_bytes(3, before))  # never written
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        worker.shutdown()
        w.close()


def test_a_peer_killed_mid_read_fails_the_step_not_a_hang(shm, procs, monkeypatch):
    monkeypatch.setattr(layer_reads, "READ_WAIT_MIN_S", 5.0)

    def kill(proc):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    lay, worker, store, w, endpoint, proc = connected_then(shm, procs, monkeypatch, 33, kill)
    try:
        job = peer_job(2, "A", [3], [4], [key(0)], endpoint)
        began = time.monotonic()
        _, meta, errors = run_step(worker, KVBMConnectorMetadata(loads=[job]), lay.caches)
        # NIXL reports the peer gone well before the 5 s deadline
        assert time.monotonic() - began < 4.5
        assert errors == {3} and meta.loads_failed["A"] == 1
        assert not meta.slots_held and meta.tier_events[("peer", "error", 0)] == 1
        assert store.quarantined == 0
        # a tier that failed is not read during the step for a while: the
        # next steps' hits load before them (where a failure costs no token)
        assert meta.layered_read_workers == -1
    finally:
        worker.shutdown()
        w.close()


def test_a_peer_hit_the_scheduler_finds_is_layered_only_where_every_worker_reads_peers_in_place(
    shm, procs
):
    """vLLM's real Scheduler asks a real peer (a pool process on TCP) for a
    prompt a router's hint names it for: the hit is returned to vLLM as
    asynchronous (loaded before its step) until every worker said it reads
    peers into its host slots in place, and synchronous (read during its
    step) once they did; the peer read lately in both."""
    sched = make_scheduler(host_blocks=16, peer_reads=True)
    k = kvbm(sched)
    info = k.info
    prompt = tokens(3 * BLOCK + 5, 71)
    port = free_port()
    spec = pool_peer.pool_spec(shm, info.page_bytes, 8, info.tier_namespace)
    w = PoolStore.open(spec, PageCodec(info.tier_namespace, info.page_bytes, None, layout="L"))
    proc, _ = pool_peer.start(shm, port, info.page_bytes, 8, namespace=info.tier_namespace)
    procs.append(proc)
    endpoint = f"tcp://127.0.0.1:{port}"
    hint = {"router_hint": {"source_control_endpoint": endpoint}}

    def hinted():
        req = make_request(prompt, max_tokens=2)
        req.kv_transfer_params = hint  # as vLLM sets it from SamplingParams.extra_args
        return req

    try:
        for key_ in keys_of(sched, prompt):
            assert w.put(key_, torch.zeros(info.page_bytes, dtype=torch.uint8))
        step(sched, layered_workers=1, layered_read_workers=1)
        k.weights.reported([(k.weights.epoch, 0, "")])  # the worker's weights, as loaded
        k._peer_read(endpoint)  # a load from that peer succeeded lately
        assert lookup(k, hinted()) == (3 * BLOCK, True)  # loaded before its step
        step(sched, layered_peer_workers=1)
        k._peer_read(endpoint)
        assert lookup(k, hinted()) == (3 * BLOCK, False)  # read during its step
    finally:
        w.close()
