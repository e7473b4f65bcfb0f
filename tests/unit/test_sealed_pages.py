"""Pages a shared store cannot read, bound to the TP rank and KV layout that wrote them.

Page format version 3 (tiers/page_*.py) on real codecs and real
DiskStores on real files. Attacks are made as someone who holds this code and
the model but not the page secret would make them: reading every stored byte,
computing names from public facts, moving files between names.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from helpers.tier_pages import SMALL, key, leaks, page, restamp  # noqa: E402
from vllm_kvbm.tiers import page_format as pf  # noqa: E402
from vllm_kvbm.tiers.page_checksum import ALG_CRC32, checksum  # noqa: E402
from vllm_kvbm.tiers.page_codec import PageCodec  # noqa: E402
from vllm_kvbm.tiers.page_format import HEADER_BYTES  # noqa: E402
from vllm_kvbm.tiers.page_names import disk_page_path, page_name  # noqa: E402

SECRET = b"kvbm-test-deployment-secret-0001"
OTHER = b"another-deployment-secret-000002"
NS = "model-a|float32|layout"


def encoded(codec: PageCodec, k: bytes, p: torch.Tensor) -> bytes:
    buf = torch.empty(codec.stored_bytes, dtype=torch.uint8)
    codec.encode_into(buf, k, p)
    return buf.numpy().tobytes()


def decode(codec: PageCodec, data: bytes, k: bytes) -> tuple[str, torch.Tensor]:
    out = torch.empty(codec.page_bytes, dtype=torch.uint8)
    return codec.decode_into(torch.frombuffer(bytearray(data), dtype=torch.uint8), k, out), out


def v2_page(ns: str, block: int, k: bytes, p: torch.Tensor, flags: int = 0) -> bytes:
    """A page as format version 2 wrote it (key in the header, CRC last over
    the header and the clear payload; GMAC field with a secret)."""
    mac_alg, mac = (pf.MAC_GMAC, os.urandom(28) + bytes(4)) if flags else (0, bytes(32))
    prefix = pf.HDR.pack(
        b"KVBT", 2, ALG_CRC32, flags, mac_alg, block, pf.namespace_hash(ns, block, 2), k, mac, 0
    )[: pf.CRC_OFF]
    crc = checksum(ALG_CRC32, prefix, p)
    return prefix + struct.pack("<I", crc) + p.numpy().tobytes()


# ---- the codec ------------------------------------------------------------------------


def test_sealed_pages_carry_no_kv_bytes_and_no_key_and_open_only_with_the_secret():
    sealed, plain = PageCodec(NS, SMALL, SECRET), PageCodec(NS, SMALL)
    k, p = key(1), page(1, SMALL)
    stored = encoded(sealed, k, p)
    assert leaks(stored, k, p) == []
    assert leaks(encoded(plain, k, p), k, p)  # the search finds them in a clear page
    assert pf.HDR.unpack(stored[:HEADER_BYTES])[7] == bytes(32)  # no key in the header
    status, out = decode(sealed, stored, k)
    assert status == "ok" and torch.equal(out, p)
    # Two writes of one page differ (a random nonce each): equal KV is not visible either.
    assert encoded(sealed, k, p)[HEADER_BYTES:] != stored[HEADER_BYTES:]
    for reader in (PageCodec(NS, SMALL, OTHER), plain):
        assert decode(reader, stored, k)[0] == "unauthenticated"


def test_a_page_opens_only_under_its_own_key_so_a_tenant_salt_is_a_key_of_its_own():
    """Page keys include the request's cache_salt: a page moved to another
    key's name (another tenant's, or another prompt's) does not open."""
    sealed = PageCodec(NS, SMALL, SECRET)
    stored = encoded(sealed, key(1), page(1, SMALL))
    assert decode(sealed, stored, key(2))[0] == "unauthenticated"
    # Per-page keys: the same plaintext under two keys and one nonce would
    # still differ; the seal field of one key's page does not open the other's.
    other = encoded(sealed, key(2), page(1, SMALL))
    swapped = restamp(stored[: pf.MAC_OFF] + other[pf.MAC_OFF : pf.CRC_OFF] + stored[pf.CRC_OFF :])
    assert decode(sealed, swapped, key(1))[0] == "unauthenticated"


def test_rank_world_size_and_layout_are_bound_into_every_page():
    k, p = key(3), page(3, SMALL)
    for secret, refused in ((None, "corrupt"), (SECRET, "unauthenticated")):
        writer = PageCodec(NS, SMALL, secret, rank=0, world_size=2, layout="L")
        stored = encoded(writer, k, p)
        assert decode(writer, stored, k)[0] == "ok"
        for reader in (
            PageCodec(NS, SMALL, secret, rank=1, world_size=2, layout="L"),
            PageCodec(NS, SMALL, secret, rank=0, world_size=1, layout="L"),
            PageCodec(NS, SMALL, secret, rank=0, world_size=2, layout="M"),
        ):
            assert decode(reader, stored, k)[0] == refused
        if secret is not None:
            # The header hash copied from the reader's own pages does not help:
            # the seal covers the rank (and layout) itself.
            rank1 = PageCodec(NS, SMALL, secret, rank=1, world_size=2, layout="L")
            forged = restamp(stored, ns8=rank1.ns8)
            assert decode(rank1, forged, k)[0] == "unauthenticated"
    # Names depend on the rank but not on the layout (the scheduler names pages).
    assert page_name(NS, SMALL, 0, 2, k) != page_name(NS, SMALL, 1, 2, k)


def test_a_workers_codec_binds_its_engines_namespace_rank_world_size_and_layout():
    """PageCodec.for_worker (the pool's and the peer reader's codec) writes
    what the codec of the same fields writes, and reads no other rank's page."""
    from types import SimpleNamespace

    info = SimpleNamespace(
        tier_namespace=NS, page_bytes=SMALL, key_namespace=SimpleNamespace(tp_size=2)
    )
    k, p = key(4), page(4, SMALL)
    for secret in (None, SECRET):
        worker = PageCodec.for_worker(info, 1, secret, "L")
        same = PageCodec(NS, SMALL, secret, rank=1, world_size=2, layout="L")
        assert worker.ns8 == same.ns8 and worker.keyed == (secret is not None)
        assert decode(same, encoded(worker, k, p), k)[0] == "ok"
        rank0 = PageCodec.for_worker(info, 0, secret, "L")
        assert decode(rank0, encoded(worker, k, p), k)[0] != "ok"


def test_damage_is_corrupt_and_forgery_unauthenticated_under_a_secret():
    sealed = PageCodec(NS, SMALL, SECRET)
    k, p = key(4), page(4, SMALL)
    stored = bytearray(encoded(sealed, k, p))
    for off in (HEADER_BYTES + 10, HEADER_BYTES + SMALL - 1, pf.MAC_OFF + 3):
        damaged = bytearray(stored)
        damaged[off] ^= 1
        assert decode(sealed, bytes(damaged), k)[0] == "corrupt", off
    # Ciphertext changed and the CRC fixed, as a forger without the secret would.
    forged = bytearray(stored[HEADER_BYTES:])
    forged[100] ^= 0xFF
    assert decode(sealed, restamp(bytes(stored), payload=bytes(forged)), k)[0] == "unauthenticated"
    # A page in the clear, planted with a valid CRC, is refused too.
    assert decode(sealed, encoded(PageCodec(NS, SMALL), k, p), k)[0] == "unauthenticated"
    # Tombstones are sealed too.
    tomb = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    sealed.encode_tombstone(tomb, k)
    assert decode(sealed, tomb.numpy().tobytes(), k)[0] == "miss"
    assert decode(PageCodec(NS, SMALL, OTHER), tomb.numpy().tobytes(), k)[0] == "unauthenticated"


def test_version_2_pages_are_never_read():
    k, p = key(5), page(5, SMALL)
    for flags in (0, pf.FLAG_MAC):
        old = v2_page(NS, SMALL, k, p, flags)
        for reader in (PageCodec(NS, SMALL), PageCodec(NS, SMALL, SECRET)):
            assert decode(reader, old, k)[0] == "corrupt"
    # and they are named otherwise: the version is in the name.
    v3_model = page_name(NS, SMALL, 0, 1, k).split("@")[0]
    assert v3_model not in pf.retired_model_names(NS, SMALL)
    assert "kvbm_" + pf.namespace_hash(NS, SMALL, 2).hex() in pf.retired_model_names(NS, SMALL)


def test_names_are_keyed_by_the_secret():
    k = key(6)
    plain = page_name(NS, SMALL, 0, 1, k)
    keyed = page_name(NS, SMALL, 0, 1, k, SECRET)
    other = page_name(NS, SMALL, 0, 1, k, OTHER)
    assert len({plain, keyed, other}) == 3
    assert len({n.split("@")[0] for n in (plain, keyed, other)}) == 3  # model part too
    assert f"{int.from_bytes(k, 'big'):x}" in plain
    assert f"{int.from_bytes(k, 'big'):x}" not in keyed and k.hex() not in keyed
    # The same secret names a page the same way in every process (scheduler and workers).
    assert keyed == page_name(NS, SMALL, 0, 1, k, SECRET)
    assert page_name(NS, SMALL, 1, 2, k, SECRET).endswith(keyed.split("@", 3)[3])
    codec = PageCodec(NS, SMALL, SECRET)
    assert SECRET.decode() not in repr(codec.__dict__) and SECRET.hex() not in repr(codec.__dict__)


# ---- the disk tier ----------------------------------------------------------------------


def _disk(d, secret=None, rank=0, world=1, **kw):
    from vllm_kvbm.tiers.disk.store import DiskStore

    return DiskStore(str(d), 64 << 20, SMALL, NS, rank, world, page_secret=secret, **kw)


def _stored_files(d) -> dict[str, bytes]:
    return {
        fn: open(os.path.join(d, fn), "rb").read() for fn in os.listdir(d) if fn.endswith(".pt")
    }


def test_a_disk_reader_without_the_secret_learns_no_kv_and_no_membership(tmp_path):
    from vllm_kvbm.tiers.disk.view import DiskView

    d = tmp_path / "disk"
    keys = [os.urandom(32) for _ in range(4)]  # no run of zeros a header also has
    pages = [page(10 + i, SMALL) for i in range(4)]
    s = _disk(d, SECRET)
    try:
        for k, p in zip(keys, pages):
            assert s.put(k, p)
        files = _stored_files(d)
        assert len(files) == 4
        everything = b"".join(files.values()) + "".join(files).encode()
        for k, p in zip(keys, pages):
            assert leaks(everything, k, p) == []
        # Membership: the names someone without the secret can compute are not there.
        for k in keys:
            assert not os.path.exists(disk_page_path(str(d), NS, SMALL, 0, 1, k))
            assert not os.path.exists(disk_page_path(str(d), NS, SMALL, 0, 1, k, OTHER))
        assert all(DiskView(str(d), NS, SMALL, 1, SECRET).contains(k) for k in keys)
        assert not any(DiskView(str(d), NS, SMALL, 1).contains(k) for k in keys)
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert s.get_into(keys[0], out) == "ok" and torch.equal(out, pages[0])
        # the host slot a page was written from stays plaintext
        assert torch.equal(pages[1], page(11, SMALL))
    finally:
        s.close()


def test_a_disk_store_with_one_secret_cannot_read_another_secrets_pages(tmp_path):
    d = tmp_path / "disk"
    a = _disk(d, SECRET)
    assert a.put(key(1), page(1, SMALL))
    a.close()
    b = _disk(d, OTHER)
    try:
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert b.adopted == 0 and not b.contains(key(1))
        assert b.get_into(key(1), out) == "miss"
        # A's file moved to the name B reads for that key: refused and removed.
        [fn] = _stored_files(d)
        path_b = disk_page_path(str(d), NS, SMALL, 0, 1, key(1), OTHER)
        os.rename(os.path.join(d, fn), path_b)
    finally:
        b.close()
    b = _disk(d, OTHER)
    try:
        assert b.adopted == 1
        assert b.get_into(key(1), out) == "unauthenticated"
        assert not os.path.exists(path_b) and b.take_removed() == [key(1)]
    finally:
        b.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
def test_a_rank_page_moved_to_the_other_ranks_name_is_refused_on_disk(tmp_path, secret):
    d = tmp_path / "disk"
    k = key(7)
    stores = [_disk(d, secret, rank=r, world=2, layout="L") for r in (0, 1)]
    try:
        for r, s in enumerate(stores):
            assert s.put(k, page(70 + r, SMALL))
    finally:
        for s in stores:
            s.close()
    paths = [disk_page_path(str(d), NS, SMALL, r, 2, k, secret) for r in (0, 1)]
    data = [open(p, "rb").read() for p in paths]
    for p, other in zip(paths, reversed(data)):  # each rank's file gets its twin's bytes
        with open(p, "wb") as f:
            f.write(other)
    want = "corrupt" if secret is None else "unauthenticated"
    stores = [_disk(d, secret, rank=r, world=2, layout="L") for r in (0, 1)]
    try:
        out = torch.empty(SMALL, dtype=torch.uint8)
        for s, p in zip(stores, paths):
            assert s.adopted == 1
            assert s.get_into(k, out) == want
            assert not os.path.exists(p)  # removed
    finally:
        for s in stores:
            s.close()


def test_version_2_files_are_deleted_at_startup_and_never_read(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    k, p = key(8), page(8, SMALL)
    old_name = "kvbm_" + pf.namespace_hash(NS, SMALL, 2).hex()
    old = d / f"{old_name}@1@0@{int.from_bytes(k, 'big'):x}@uint8.pt"
    old.write_bytes(v2_page(NS, SMALL, k, p))
    # a v2 page copied under this version's name reads as corrupt, and goes
    renamed = disk_page_path(str(d), NS, SMALL, 0, 1, k)
    with open(renamed, "wb") as f:
        f.write(v2_page(NS, SMALL, k, p))
    s = _disk(d)
    try:
        assert not old.exists() and s.adopted == 1
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert s.get_into(k, out) == "corrupt" and not os.path.exists(renamed)
    finally:
        s.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_sealed_pages_round_trip_through_both_disk_read_paths(tmp_path, direct):
    d = tmp_path / "disk"
    s = _disk(d, SECRET, direct_reads=direct)
    try:
        pages = [page(30 + i, SMALL) for i in range(3)]
        for i, p in enumerate(pages):
            assert s.put(key(30 + i), p)
        for fn in _stored_files(d):  # out of the page cache: O_DIRECT where allowed
            fd = os.open(os.path.join(d, fn), os.O_RDONLY)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        outs = [torch.empty(SMALL, dtype=torch.uint8) for _ in pages]
        assert s.get_many_into([(key(30 + i), o) for i, o in enumerate(outs)]) == ["ok"] * 3
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
        assert s.get_into(key(30), outs[0]) == "ok" and torch.equal(outs[0], pages[0])
    finally:
        s.close()


def test_layout_fingerprint_ignores_num_blocks_and_sees_the_layout():
    from vllm_kvbm.worker.tier_io import layout_fingerprint

    def caches(num_blocks, dtype=torch.float16, heads=4):
        return {
            f"layers.{i}": torch.empty(num_blocks, 2, heads, 32, 8, dtype=dtype) for i in range(2)
        }

    base = layout_fingerprint(caches(10), 10)
    assert base == layout_fingerprint(caches(13), 13)
    assert base != layout_fingerprint(caches(10, torch.bfloat16), 10)
    assert base != layout_fingerprint(caches(10, heads=2), 10)
    kv_first = {n: torch.empty(2, 10, 4, 32, 8, dtype=torch.float16) for n in caches(10)}
    assert base != layout_fingerprint(kv_first, 10)
    assert layout_fingerprint(kv_first, 10) == layout_fingerprint(
        {n: torch.empty(2, 11, 4, 32, 8, dtype=torch.float16) for n in caches(11)}, 11
    )
