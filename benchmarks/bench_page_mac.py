"""What sealing pages costs, against the disk tier's page read, from one run.

Two real DiskStores (LMCache's disk backend, files in a temporary directory)
with 2 MiB pages, one without a page secret and one with; the same pages
are read back through ``get_into`` (read into the slot a chunk at a time,
each chunk checked as it arrives: the checksum without a secret, decrypted
and authenticated with one, AES-256-GCM), warm (page cache) and cold (each
file's cached pages dropped with posix_fadvise first), next to a plain read
of the same file (preadv into a buffer, nothing checked). Also the seal
alone on one page (with and without its per-page key derivation), and the
constructions it was chosen over (v2's authenticate-only GMAC among them).

    .venv/bin/python benchmarks/bench_page_mac.py [--pages 32] [--rounds 5] [--dir DIR]

Prints a table; the ratios are the figures to compare (the machine is shared).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import tempfile
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

MiB = 1024 * 1024


def per_call(fn, reps: int, rounds: int = 5) -> float:
    """Median over rounds of the mean seconds per call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def drop_cached(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_cached(path: str) -> None:
    """Reads the file once, buffered, so the page cache holds it (the tier
    reads a page none of which is cached with O_DIRECT, which leaves the
    cache as it was)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(MiB):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="parent of the disk directories (default: tmp)")
    args = ap.parse_args()

    import blake3
    import cryptography
    import torch

    from vllm_kvbm.tiers import page_checksum, page_format
    from vllm_kvbm.tiers.disk.store import DiskStore
    from vllm_kvbm.tiers.page_codec import PageCodec

    block = int(args.block_mib * MiB)
    secret = os.urandom(32)
    g = torch.Generator().manual_seed(0)
    pages = [
        torch.randint(0, 256, (block,), dtype=torch.uint8, generator=g) for _ in range(args.pages)
    ]
    keys = [i.to_bytes(32, "big") for i in range(args.pages)]
    out = torch.empty(block, dtype=torch.uint8)

    # The seal alone, as the codec computes it on a write: per-page key,
    # encrypt into a scratch buffer, checksum, tag.
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    codec = PageCodec("bench", block, secret)
    payload = pages[0]
    view = memoryview(payload.numpy())
    scratch = memoryview(bytearray(block))

    def seal():
        signer = codec.signer(keys[0])
        signer.seal(view, scratch)
        signer.header()

    aes = algorithms.AES(secret)

    def gmac():  # v2's MAC: authenticate only, the payload stays in the clear
        ctx = Cipher(aes, modes.GCM(os.urandom(12))).encryptor()
        ctx.authenticate_additional_data(view)
        ctx.finalize()

    def blake3_mac():  # v1/v2's keyed BLAKE3
        blake3.blake3(view, key=secret).digest()

    t_mac = per_call(seal, 50)
    t_derive = per_call(lambda: codec._seal._page_key(keys[0]), 2000)
    alternatives = {
        "HMAC-SHA256": per_call(lambda: hmac.new(secret, view, "sha256").digest(), 20),
        "keyed BLAKE2b-256": per_call(
            lambda: hashlib.blake2b(view, key=secret, digest_size=32).digest(), 20
        ),
        "keyed BLAKE3 (v2, authenticate only)": per_call(blake3_mac, 50),
        "AES-256-GMAC (v2, authenticate only)": per_call(gmac, 50),
        "AES-256-GCM, encrypt + authenticate (chosen)": per_call(seal, 50),
        "its per-page key derivation alone (keyed BLAKE3 + AES key schedule)": t_derive,
        f"{page_checksum.checksum_name()} (the checksum written, not a MAC)": per_call(
            lambda: page_checksum.checksum(page_checksum.WRITE_ALG, b"", payload), 50
        ),
        "CRC-32C (libcrc32c, written before isal)": per_call(
            lambda: page_checksum.checksum(page_checksum.ALG_CRC32C, b"", payload), 50
        ),
    }

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cap = (args.pages + 2) * page_format.disk_page_bytes(block)
        plain = DiskStore(os.path.join(tmp, "plain"), cap, block, "bench", 0, 1)
        keyed = DiskStore(os.path.join(tmp, "keyed"), cap, block, "bench", 0, 1, page_secret=secret)
        try:
            for store in (plain, keyed):
                for k, p in zip(keys, pages):
                    assert store.put(k, p)

            raw_buf = memoryview(bytearray(page_format.HEADER_BYTES + block))

            def read_all(store, cold: bool, raw: bool = False) -> float:
                total = 0.0
                for k in keys:
                    path = store._disk._key_to_path(store._ckey(k))
                    (drop_cached if cold else read_cached)(path)
                    start = time.perf_counter()
                    if raw:  # the bytes alone: one buffered preadv, nothing checked
                        fd = os.open(path, os.O_RDONLY)
                        try:
                            os.preadv(fd, [raw_buf], 0)
                        finally:
                            os.close(fd)
                        status = "ok"
                    else:
                        status = store.get_into(k, out)
                    total += time.perf_counter() - start
                    assert status == "ok", status
                return total / len(keys)

            def mac_all() -> float:
                start = time.perf_counter()
                for k, p in zip(keys, pages):
                    signer = codec.signer(k)
                    signer.seal(memoryview(p.numpy()), scratch)
                    signer.header()
                return (time.perf_counter() - start) / len(pages)

            reads = {(n, c): [] for n in ("raw", "plain", "keyed") for c in (False, True)}
            macs = []
            for _ in range(args.rounds):  # interleaved, so load drift hits all alike
                for cold in (False, True):
                    reads[("raw", cold)].append(read_all(plain, cold, raw=True))
                    for name, store in (("plain", plain), ("keyed", keyed)):
                        reads[(name, cold)].append(read_all(store, cold))
                macs.append(mac_all())
            read = {k: statistics.median(v) for k, v in reads.items()}
            # the MAC against the plain read of the same round, median over rounds
            ratio = {
                cold: statistics.median(m / r for m, r in zip(macs, reads[("plain", cold)]))
                for cold in (False, True)
            }
            t_mac_rounds = statistics.median(macs)
        finally:
            plain.close()
            keyed.close()

    ms = 1e3
    print(
        f"page {block / MiB:g} MiB, {args.pages} pages x {args.rounds} rounds, "
        f"{os.cpu_count()} CPUs, blake3 {blake3.__version__}, cryptography "
        f"{cryptography.__version__}"
    )
    print()
    print("| | per page | GB/s |")
    print("|---|---|---|")
    print(
        f"| page seal (AES-256-GCM, as a sealed write computes it) | {t_mac * ms:.3f} ms | "
        f"{block / t_mac / 1e9:.1f} |"
    )
    print(
        f"| the same, over the {args.pages} pages, between the reads below | "
        f"{t_mac_rounds * ms:.3f} ms | {block / t_mac_rounds / 1e9:.1f} |"
    )
    for name, t in alternatives.items():
        print(f"| {name} | {t * ms:.3f} ms | {block / t / 1e9:.1f} |")
    print()
    print(
        "| disk tier, get_into | plain read (preadv) | no secret | with secret (sealed) "
        "| difference | seal / read (no secret), per round |"
    )
    print("|---|---|---|---|---|---|")
    for cold in (False, True):
        r, a, b = read[("raw", cold)], read[("plain", cold)], read[("keyed", cold)]
        print(
            f"| {'cold (page cache dropped)' if cold else 'warm (page cache)'} | "
            f"{r * ms:.3f} ms | {a * ms:.3f} ms | {b * ms:.3f} ms | {(b - a) * ms:+.3f} ms | "
            f"{ratio[cold]:.2f} |"
        )


if __name__ == "__main__":
    main()
