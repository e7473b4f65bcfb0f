"""Pages that prove where they came from: pages sealed with the deployment secret.

Real parts throughout: the codec on real pages, real DiskStores on real files,
RemoteStores against a real LMCache server, vLLM's real Scheduler fed by the
worker's real TierIO, and real engines. Forged pages are built the way an
attacker who has this code, the model and write access would build them:
the right key and namespace, a valid CRC, and no secret (or the wrong one).
Page names are keyed by the secret too, so an attacker cannot even find the
names to plant at; the tests plant there anyway (the test knows the secret),
as the worst case. What a reader of the store learns: test_sealed_pages.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,  # noqa: E402
    random_prompt,
    shutdown,
)
from test_remote_store import raw_get, raw_put  # noqa: E402
from helpers.tier_pages import SMALL, key, page, restamp, tier_of  # noqa: E402
from vllm_kvbm.config.secrets import Secret  # noqa: E402
from vllm_kvbm.tiers import page_format as pf  # noqa: E402
from vllm_kvbm.tiers import page_checksum  # noqa: E402
from vllm_kvbm.tiers.page_codec import PageCodec  # noqa: E402
from vllm_kvbm.tiers.page_format import HEADER_BYTES  # noqa: E402
from vllm_kvbm.tiers.page_names import disk_page_path  # noqa: E402

SECRET = b"kvbm-test-deployment-secret-0001"
OTHER = b"another-deployment-secret-000002"
NS = "model-a|float32|layout"


# ---- forging, as an attacker would -------------------------------------------


def _header_fields(buf: bytes) -> list:
    return list(pf.HDR.unpack(buf[:HEADER_BYTES]))


def encoded(codec: PageCodec, k: bytes, p: torch.Tensor) -> bytes:
    buf = torch.empty(codec.stored_bytes, dtype=torch.uint8)
    codec.encode_into(buf, k, p)
    return buf.numpy().tobytes()


def decode(codec: PageCodec, data: bytes, k: bytes, out: torch.Tensor) -> str:
    return codec.decode_into(torch.frombuffer(bytearray(data), dtype=torch.uint8), k, out)


def v1_page(ns: str, block: int, k: bytes, p: torch.Tensor) -> bytes:
    """A page in format version 1 (64-byte header, no MAC field), as v1 wrote it."""
    hdr = struct.Struct("<4sHHIQ8s32sI")
    ns8 = pf.namespace_hash(ns, block, 1)
    prefix = hdr.pack(b"KVBT", 1, page_checksum.ALG_CRC32C, 0, block, ns8, k, 0)[:60]
    crc = page_checksum.checksum(page_checksum.ALG_CRC32C, prefix, p)
    return prefix + struct.pack("<I", crc) + p.numpy().tobytes()


# ---- the disk tier ----------------------------------------------------------------


def _disk(d, secret=None, **kw):
    from vllm_kvbm.tiers.disk.store import DiskStore

    return DiskStore(str(d), 64 << 20, SMALL, NS, 0, 1, page_secret=secret, **kw)


def test_disk_refuses_planted_and_forged_pages_and_removes_them(tmp_path):
    d = tmp_path / "cache"
    for secret, k in ((None, key(1)), (OTHER, key(2))):  # other engines wrote these...
        s = _disk(d, secret)
        assert s.put(k, page(9, SMALL))
        s.close()
        # ...and they are moved to the names this deployment reads
        os.rename(
            disk_page_path(str(d), NS, SMALL, 0, 1, k, secret),
            disk_page_path(str(d), NS, SMALL, 0, 1, k, SECRET),
        )
    # Planted by hand: right name and CRC; a made-up seal.
    planted = disk_page_path(str(d), NS, SMALL, 0, 1, key(5), SECRET)
    with open(planted, "wb") as f:
        sealed = encoded(PageCodec(NS, SMALL, SECRET), key(5), page(9, SMALL))
        f.write(restamp(sealed, mac=os.urandom(28) + bytes(4)))
    # Files of older versions of this namespace are deleted at startup.
    old = [
        d / f"{name}@1@0@{int.from_bytes(key(6), 'big'):x}@uint8.pt"
        for name in pf.retired_model_names(NS, SMALL)
    ]
    for path in old:
        path.write_bytes(v1_page(NS, SMALL, key(6), page(6, SMALL)))

    s = _disk(d, SECRET)
    try:
        assert s.adopted == 3 and not any(path.exists() for path in old)
        assert s.put(key(3), page(3, SMALL)) and s.put(key(4), page(4, SMALL))
        # Rewritten in place while the engine runs: key(4)'s page's stored
        # bytes under key(3)'s name and seal field, the CRC fixed.
        p3 = disk_page_path(str(d), NS, SMALL, 0, 1, key(3), SECRET)
        p4 = disk_page_path(str(d), NS, SMALL, 0, 1, key(4), SECRET)
        genuine = open(p3, "rb").read()
        with open(p3, "wb") as f:
            f.write(restamp(genuine, payload=open(p4, "rb").read()[HEADER_BYTES:]))
        out = torch.empty(SMALL, dtype=torch.uint8)
        for k in (key(1), key(2), key(5), key(3)):
            path = disk_page_path(str(d), NS, SMALL, 0, 1, k, SECRET)
            assert os.path.exists(path)
            # Read into the slot and checked there: the status says never use it
            # (a failed load's slots are dropped: test_tier_policy's
            # test_a_failed_disk_load_drops_its_slots_and_the_request_recomputes,
            # test_tiers_e2e's corrupt page).
            assert s.get_into(k, out) == "unauthenticated", k
            assert not os.path.exists(path) and not s.contains(k)
            assert s.get_into(k, out) == "miss"
        assert s.get_into(key(4), out) == "ok" and torch.equal(out, page(4, SMALL))
    finally:
        s.close()
    # An engine without the secret cannot even name the sealed page.
    plain = _disk(d)
    try:
        assert plain.adopted == 0 and plain.get_into(key(4), out) == "miss"
    finally:
        plain.close()


# ---- the remote tier (a real LMCache server) ---------------------------------------


def test_remote_refuses_pages_without_a_valid_mac_and_overwrites_them(lm_server):
    from vllm_kvbm.tiers.lm.store import RemoteStore

    def store(secret):
        return RemoteStore(lm_server.url, SMALL, NS, 0, 1, timeout_s=3.0, page_secret=secret)

    plain, keyed, other = store(None), store(SECRET), store(OTHER)
    try:
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert plain.put(key(1), page(1, SMALL)) and other.put(key(2), page(2, SMALL))
        assert keyed.put(key(3), page(3, SMALL)) and keyed.put(key(4), page(4, SMALL))
        # Their pages are under other names: misses here. Copied to this
        # deployment's names (as someone who could compute them would):
        assert keyed.get_into(key(1), out) == "miss" and keyed.get_into(key(2), out) == "miss"
        raw_put(keyed, key(1), raw_get(plain, key(1)))
        raw_put(keyed, key(2), raw_get(other, key(2)))
        # Forged on the server: key(4)'s stored bytes under key(3)'s seal, CRC fixed.
        raw_put(
            keyed,
            key(3),
            restamp(raw_get(keyed, key(3)), payload=raw_get(keyed, key(4))[HEADER_BYTES:]),
        )
        for k in (key(1), key(2), key(3)):
            assert keyed.get_into(k, out) == "unauthenticated", k
            assert not keyed.contains(k) and keyed.get_into(k, out) == "miss"  # tombstoned
        assert keyed.get_into(key(4), out) == "ok" and torch.equal(out, page(4, SMALL))
        # Without this secret the sealed page cannot even be named.
        assert plain.get_into(key(4), out) == "miss" and other.get_into(key(4), out) == "miss"
    finally:
        for s in (plain, keyed, other):
            s.close()


# ---- the counter reaches the scheduler through the worker metadata -------------------


def test_auth_failures_reach_the_scheduler_stats_through_the_worker_metadata(tmp_path):
    from helpers.scheduler_harness import BLOCK, kvbm, make_request, make_scheduler, worker_output
    from helpers.scheduler_harness import keys_of, tokens
    from vllm_kvbm.messages import KVBMWorkerMetadata
    from vllm_kvbm.tiers.disk.store import DiskStore
    from vllm_kvbm.worker.tier_io import TierIO

    secret_file = tmp_path / "page.secret"
    secret_file.write_bytes(SECRET)
    d = tmp_path / "disk"
    d.mkdir()
    sched = make_scheduler(
        host_blocks=8,
        disk_cache_dir=str(d),
        disk_cache_size="64MiB",
        page_secret_file=str(secret_file),
    )
    k = kvbm(sched)
    secret = sched.connector.config.page_secret  # parsed from the file by the connector
    assert secret == Secret(SECRET, "test")
    prompt = tokens(3 * BLOCK + 5, 21)
    keys = keys_of(sched, prompt)
    bb, ns = k.info.block_bytes, k.info.tier_namespace
    # Planted without the secret (as an engine without it, or an attacker,
    # writes them), at the names this deployment reads.
    for key_ in keys[:2]:
        with open(disk_page_path(str(d), ns, bb, 0, 1, key_, secret.reveal()), "wb") as f:
            f.write(encoded(PageCodec(ns, bb), key_, torch.zeros(bb, dtype=torch.uint8)))
    deadline = time.monotonic() + 10
    while not all(tier_of(k.lower, key_) == "disk" for key_ in keys[:2]):
        assert time.monotonic() < deadline, "planted pages never became visible"
        time.sleep(0.05)

    worker_store = DiskStore(str(d), 64 << 20, bb, ns, 0, 1, page_secret=secret.reveal())
    io = TierIO()
    io.add(worker_store)
    try:
        req = make_request(prompt, max_tokens=2)
        sched.add_request(req)
        deadline = time.monotonic() + 10
        while not (out := sched.schedule()).kv_connector_metadata.loads:
            # the disk is asked on the connector's background thread
            sched.update_from_output(out, worker_output(sched, out))
            assert time.monotonic() < deadline, "the disk pages were never found"
            time.sleep(0.005)
        [load] = out.kv_connector_metadata.loads
        assert [tier for _, tier, _ in load.fetch] == ["disk", "disk"]
        pool = torch.zeros(8, bb, dtype=torch.uint8)
        io.fetch(load, pool)
        meta = KVBMWorkerMetadata()
        deadline = time.monotonic() + 10
        while not (ready := io.poll(meta)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ready == [(load, False, False, None)]
        assert meta.tier_events == {("disk", "unauthenticated", 0): 2}
        assert sorted(meta.bad_pages) == sorted(("disk", key_) for key_ in keys[:2])
        mro = worker_output(
            sched,
            out,
            finished_recving=[req.request_id],
            loads_failed=[req.request_id],
            invalid_block_ids=load.block_ids,
        )
        kv_out = mro.kv_connector_output
        kv_out.kv_connector_worker_meta = kv_out.kv_connector_worker_meta.aggregate(meta)
        sched.update_from_output(out, mro)
        assert k.stats.total["page_auth_failures"] == 2
        assert k.stats.total["checksum_failures"] == 0
        assert k.stats.total["load_error_blocks"] == 2
        # Removed: the scheduler's disk index (the directory) no longer has them.
        assert all(tier_of(k.lower, key_) is None for key_ in keys[:2])
    finally:
        io.close()


# ---- a real engine ------------------------------------------------------------------

E2E_PROMPT = random_prompt(6 * BLOCK_SIZE + 3, seed=9101)
# A host tier just over the prompt: clearing it takes two short fillers.
E2E_HOST_BLOCKS = 12


def _flags(path) -> int:
    with open(path, "rb") as f:
        return _header_fields(f.read(HEADER_BYTES))[3]


@pytest.mark.timeout(900)
def test_engine_with_a_secret_refuses_planted_pages_and_onboards_its_own(
    model_dir, plain_llm, tmp_path
):
    from test_engine_e2e import expected_hit_tokens, generate, reference
    from test_tiers_e2e import clear_engine_and_host, settle
    from vllm_kvbm.tools.server import kvbm_transfer_config

    d = tmp_path / "disk"
    d.mkdir()
    secret_file = tmp_path / "page.secret"
    secret_file.write_bytes(os.urandom(32))
    secret_file.chmod(0o600)

    def config(**extra):
        return kvbm_transfer_config(
            host_cache_blocks=E2E_HOST_BLOCKS,
            disk_cache_dir=str(d),
            disk_cache_size="1GiB",
            **EVERY_PAGE_LOADED,
            **extra,
        )

    want = reference(plain_llm, [E2E_PROMPT])
    n_pages = len(E2E_PROMPT) // BLOCK_SIZE

    # The attacker: the same public model with KVBM and no secret, on the same
    # directory. It plants another prompt's KV under E2E_PROMPT's keys, with
    # valid CRCs. (Shuffling the prompt's own blocks would not do: attention
    # over the same set of K/V barely changes on this small random model.)
    attacker = make_llm(config())
    try:
        generate(attacker, [E2E_PROMPT])
        settle(attacker)
        pages = sorted(d.glob("*.pt"))
        generate(attacker, [random_prompt(len(E2E_PROMPT), seed=9102)])
        settle(attacker)
        donors = sorted(set(d.glob("*.pt")) - set(pages))
        assert len(pages) == len(donors) == n_pages
        poison = [donor.read_bytes()[HEADER_BYTES:] for donor in donors]
        for path, payload in zip(pages, poison):
            path.write_bytes(restamp(path.read_bytes(), payload=payload))
        assert all(_flags(p) & pf.FLAG_SEALED == 0 for p in pages)
        # Without a page secret the planted KV is loaded: wrong outputs.
        clear_engine_and_host(attacker, E2E_HOST_BLOCKS)
        d2d = kvbm_counter("onboard_blocks_d2d")
        got, _ = generate(attacker, [E2E_PROMPT])
        assert kvbm_counter("onboard_blocks_d2d") - d2d == n_pages
        assert got != want
    finally:
        shutdown(attacker)

    before = set(d.glob("*.pt"))  # the planted pages and the attacker's fillers
    engine = make_llm(config(page_secret_file=str(secret_file)))
    try:
        auth, checksum = kvbm_counter("page_auth_failures"), kvbm_counter("checksum_failures")
        d2d = kvbm_counter("onboard_blocks_d2d")
        got, _ = generate(engine, [E2E_PROMPT])
        assert got == want
        # The planted pages are not even looked at: names are keyed by the secret.
        assert kvbm_counter("page_auth_failures") == auth
        assert kvbm_counter("checksum_failures") == checksum
        assert kvbm_counter("onboard_blocks_d2d") == d2d  # none was loaded

        # Computed and written, sealed, under names of its own.
        settle(engine)
        sealed = sorted(set(d.glob("*.pt")) - before)
        assert len(sealed) == n_pages and all(_flags(p) & pf.FLAG_SEALED for p in sealed)

        # Its own pages come back from disk, equal to a plain engine's recompute.
        clear_engine_and_host(engine, E2E_HOST_BLOCKS)
        got, cached = generate(engine, [E2E_PROMPT])
        assert got == want
        assert cached[0] == expected_hit_tokens(len(E2E_PROMPT))
        assert kvbm_counter("onboard_blocks_d2d") - d2d == cached[0] // BLOCK_SIZE
        assert kvbm_counter("page_auth_failures") == auth

        # One of them rewritten in place with another page's stored bytes
        # under its genuine seal field (CRC fixed): refused and counted;
        # outputs stay right.
        clear_engine_and_host(engine, E2E_HOST_BLOCKS)
        victim = sealed[0]
        victim.write_bytes(
            restamp(victim.read_bytes(), payload=sealed[1].read_bytes()[HEADER_BYTES:])
        )
        got, _ = generate(engine, [E2E_PROMPT])
        assert got == want
        assert kvbm_counter("page_auth_failures") - auth == 1
        assert kvbm_counter("checksum_failures") == checksum
    finally:
        shutdown(engine)


def test_bench_page_mac_runs_and_reports_the_ratio():
    import subprocess
    import sys

    from helpers import ROOT

    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_page_mac.py"),
            "--pages",
            "3",
            "--rounds",
            "1",
            "--block-mib",
            "0.25",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")
    }
    for name in ("warm (page cache)", "cold (page cache dropped)"):
        ratio = float(rows[name].split("|")[6])  # seal / read
        assert ratio > 0, rows[name]
    assert "AES-256-GCM, encrypt + authenticate (chosen)" in rows and "HMAC-SHA256" in rows
