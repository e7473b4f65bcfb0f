"""What the page MAC costs, against the disk tier's page read, from one run.

Two real DiskStores (LMCache's disk backend, files in a temporary directory)
with 2 MiB pages, one without a page secret and one with; the same pages
are read back through ``get_into`` (read into the slot a chunk at a time,
each chunk checked as it arrives: the checksum without a secret, the MAC
with one), warm (page cache) and
cold (each file's cached pages dropped with posix_fadvise first). Also the
MAC alone on one page, and the constructions it was chosen over.

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

    from vllm_kvbm.tiers import page_format
    from vllm_kvbm.tiers.disk import DiskStore
    from vllm_kvbm.tiers.page_format import PageCodec

    block = int(args.block_mib * MiB)
    secret = os.urandom(32)
    g = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, (block,), dtype=torch.uint8, generator=g)
             for _ in range(args.pages)]
    keys = [i.to_bytes(32, "big") for i in range(args.pages)]
    out = torch.empty(block, dtype=torch.uint8)

    # The MAC alone, as the codec computes it (namespace-keyed state copied, header + payload).
    macs = PageCodec("bench", block, secret)._macs
    mac = macs.sign
    fields = bytes(page_format._MAC_OFF)
    payload = pages[0]
    view = memoryview(payload.numpy())
    t_mac = per_call(lambda: mac.digest(fields, payload), 50)
    alternatives = {
        "HMAC-SHA256": per_call(lambda: hmac.new(secret, view, "sha256").digest(), 20),
        "keyed BLAKE2b-256": per_call(
            lambda: hashlib.blake2b(view, key=secret, digest_size=32).digest(), 20),
        "keyed BLAKE3 (chosen until 2026-12-03; still verified)": per_call(
            lambda: macs.by_alg[page_format._MAC_BLAKE3].digest(fields, payload), 50),
        "AES-256-GMAC (chosen)": per_call(lambda: mac.digest(fields, payload), 50),
        f"{page_format.checksum_name()} (the checksum written, not a MAC)": per_call(
            lambda: page_format._checksum(page_format._WRITE_ALG, b"", payload), 50),
        "CRC-32C (libcrc32c, written before isal)": per_call(
            lambda: page_format._checksum(page_format._ALG_CRC32C, b"", payload), 50),
    }

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cap = (args.pages + 2) * page_format.disk_page_bytes(block)
        plain = DiskStore(os.path.join(tmp, "plain"), cap, block, "bench", 0, 1)
        keyed = DiskStore(os.path.join(tmp, "keyed"), cap, block, "bench", 0, 1,
                          page_secret=secret)
        try:
            for store in (plain, keyed):
                for k, p in zip(keys, pages):
                    assert store.put(k, p)

            def read_all(store, cold: bool) -> float:
                total = 0.0
                for k in keys:
                    path = store._disk._key_to_path(store._ckey(k))
                    (drop_cached if cold else read_cached)(path)
                    start = time.perf_counter()
                    status = store.get_into(k, out)
                    total += time.perf_counter() - start
                    assert status == "ok", status
                return total / len(keys)

            def mac_all() -> float:
                start = time.perf_counter()
                for p in pages:
                    mac.digest(fields, p)
                return (time.perf_counter() - start) / len(pages)

            reads = {(n, c): [] for n in ("plain", "keyed") for c in (False, True)}
            macs = []
            for _ in range(args.rounds):  # interleaved, so load drift hits all alike
                for cold in (False, True):
                    for name, store in (("plain", plain), ("keyed", keyed)):
                        reads[(name, cold)].append(read_all(store, cold))
                macs.append(mac_all())
            read = {k: statistics.median(v) for k, v in reads.items()}
            # the MAC against the plain read of the same round, median over rounds
            ratio = {cold: statistics.median(m / r for m, r in zip(macs, reads[("plain", cold)]))
                     for cold in (False, True)}
            t_mac_rounds = statistics.median(macs)
        finally:
            plain.close()
            keyed.close()

    ms = 1e3
    print(f"page {block / MiB:g} MiB, {args.pages} pages x {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, blake3 {blake3.__version__}, cryptography "
          f"{cryptography.__version__}")
    print()
    print("| | per page | GB/s |")
    print("|---|---|---|")
    print(f"| page MAC (AES-256-GMAC, as the codec computes it) | {t_mac * ms:.3f} ms | "
          f"{block / t_mac / 1e9:.1f} |")
    print(f"| the same, over the {args.pages} pages, between the reads below | "
          f"{t_mac_rounds * ms:.3f} ms | {block / t_mac_rounds / 1e9:.1f} |")
    for name, t in alternatives.items():
        print(f"| {name} | {t * ms:.3f} ms | {block / t / 1e9:.1f} |")
    print()
    print("| disk tier, get_into | no secret | with secret | difference | "
          "MAC / read (no secret), per round |")
    print("|---|---|---|---|---|")
    for cold in (False, True):
        a, b = read[("plain", cold)], read[("keyed", cold)]
        print(f"| {'cold (page cache dropped)' if cold else 'warm (page cache)'} | "
              f"{a * ms:.3f} ms | {b * ms:.3f} ms | {(b - a) * ms:+.3f} ms | "
              f"{ratio[cold]:.2f} |")


if __name__ == "__main__":
    main()
