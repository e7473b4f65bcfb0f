"""The disk tier's read/write bandwidth against a plain read/write of the same bytes, one run.

No engine. Pages of the real block size (2 MiB, the local model's block) are
written to and read back from a temporary directory on the filesystem under
test, by each path in turn:

- raw 1 file:   plain os.write / readinto of one big file (the bar's reference)
- raw per page: plain open/write/close and open/readinto/close, one file per page
- DiskStore:    the disk tier itself (vllm_kvbm.tiers.disk.store), one page at a time
                on one thread; and with --inflight pages in flight on a small
                thread pool, as TierIO's disk writers and readers call it
- LMCache LocalDiskBackend: LMCache's disk backend as the tier used it up to
                2026-12-03 (page encoded into LMCache staging memory, written by
                LMCache's disk worker, read back into staging and verified,
                then copied into the host slot)
- LMCache NixlStorageBackend: LMCache's NIXL storage backend with the NIXL
                POSIX plugin (GDS needs CUDA), pages staged in LMCache memory
                and copied into the host slot; writes into its preallocated file pool
- preadv direct: the tier's page files read straight into host-slot tensors
                (header + payload scattered with os.preadv), --inflight in flight
- O_DIRECT:     the same with O_DIRECT into 4 KiB aligned buffers (the 96-byte
                header puts the payload off alignment, so a bounce copy follows),
                and raw O_DIRECT of the big file for reference; "refused" where the
                filesystem does not allow it

Reads are measured warm (every file's bytes written again just before, 1 MiB
per call, and synced: the page cache holds it as the tier's writes leave it;
see warm() for why not by reading it) and cold: caches dropped with
``echo 1 > /proc/sys/vm/drop_caches`` where writable (root), else each
file's cached pages dropped with posix_fadvise(POSIX_FADV_DONTNEED); the
table says which. Every read pass of a path is timed next to a pass of the
reference (raw 1 file), in alternating order, and its ratio is the median
over --reps of those adjacent pairs' ratios (the GB/s columns are plain
medians): load from other work then cancels out of the ratios.

Writes are fsync-free (as the tier writes) and compared interleaved: the
reference and the path under test each write WRITE_BATCH pages in turn (who
goes first alternating), each from an empty directory, caches synced before
and after; a path's write time is the sum of its batches. Writing into the
page cache is dominated by this VM: the same code's writes ran 0.7 ms to
9.5 ms a page from one pass to the next, in regimes lasting seconds (fresh
memory's first touch, the host's load), so whole passes run one after the
other compared regimes, not paths.

Bars: read >= 0.9x and write >= 0.7x raw (one big file), taken on the tier
as TierIO drives it: writes several in flight (the store's write_inflight
writer threads, 4 for the disk), reads several in flight (get_many_into).

    .venv/bin/python benchmarks/bench_disk.py [--dir DIR] [--block-mib 2] [--total-mib 512]
        [--inflight 4] [--reps 3] [--secret]

Other work may run on the machine: compare the ratios, not the GB/s.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench_disk_io import Cache, MiB, Path, aligned_u8, fs_type, timed, view_of, warm
from bench_disk_paths import DiskPaths

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

READ_BAR, WRITE_BAR = 0.9, 0.7
# Pages each side of a write comparison writes before the other's turn.
WRITE_BATCH = 8


class Bench(DiskPaths):
    def __init__(self, args):
        import torch

        from vllm_kvbm.tiers.page_format import HEADER_BYTES

        self.args = args
        self.block = int(args.block_mib * MiB)
        self.n = max(1, int(args.total_mib * MiB) // self.block)
        self.header = HEADER_BYTES
        self.stored = HEADER_BYTES + self.block
        self.total = self.n * self.stored  # bytes on disk for every path
        self.secret = os.urandom(32) if args.secret else None
        g = torch.Generator().manual_seed(0)
        # Distinct pages without generating 512 MiB of random numbers.
        base = torch.randint(0, 256, (self.block,), dtype=torch.uint8, generator=g)
        self.pages = []
        for i in range(self.n):
            p = base.clone()
            p[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
            self.pages.append(p)
        self.keys = [bytes([7]) * 24 + i.to_bytes(8, "big") for i in range(self.n)]
        # The host slots reads land in (as the host pool: one big tensor).
        self.slots = aligned_u8(self.n * self.block).view(self.n, self.block)
        self.slot_views = [view_of(s) for s in self.slots]
        self.page_views = [view_of(p) for p in self.pages]
        self.root = tempfile.mkdtemp(prefix="kvbm-bench-disk-", dir=args.dir)
        self.cache = Cache()
        self.pool = ThreadPoolExecutor(args.inflight)
        self.paths: list[Path] = []

    def fresh(self, name: str) -> str:
        d = os.path.join(self.root, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def check_slots(self, label: str) -> None:
        import torch

        for i in (0, self.n // 2, self.n - 1):
            if not torch.equal(self.slots[i], self.pages[i]):
                raise AssertionError(f"{label}: page {i} read back wrong")

    # -- the run -------------------------------------------------------------
    def read_pass(self, p: Path, kind: str) -> float:
        """Seconds for one read pass of ``kind`` ("warm" or "cold")."""
        self.slots.zero_()
        if kind == "warm":
            warm(p.files())  # the page cache holds them (the tier's own reads may not fill it)
        else:
            self.cache.drop(p.files())
        t = timed(p.read)
        if p.warm or "copy" in p.name:  # raw O_DIRECT reads into a scratch buffer
            self.check_slots(p.name)
        return t

    def write_pair(self, raw: Path, p: Path, rep: int) -> tuple[float, float]:
        """Seconds the reference and ``p`` take to write every page, their
        writes interleaved a batch of WRITE_BATCH pages at a time (which goes
        first alternating), each from an empty directory, caches synced."""
        for q in (raw, p):
            q.prepare()
        os.sync()
        t = {raw.name: 0.0, p.name: 0.0}
        for j, start in enumerate(range(0, self.n, WRITE_BATCH)):
            batch = range(start, min(start + WRITE_BATCH, self.n))
            for q in (raw, p) if (rep + j) % 2 == 0 else (p, raw):
                t[q.name] += timed(lambda: q.write(batch))
        for q in (raw, p):
            q.finish()
        os.sync()  # its writeback does not slow what runs next
        return t[raw.name], t[p.name]

    def run(self) -> None:
        """Each path's pass is timed next to a pass of the reference (raw 1 file),
        in alternating order; its ratio is the median of those pairs' ratios, so
        drift in the machine's load or the device's speed cancels out."""
        raw = self.paths[0]
        for rep in range(self.args.reps):
            for kinds in (["write"], ["warm", "cold"]):
                for i, p in enumerate(self.paths):
                    for kind in kinds:
                        if p.note or (p.write is None if kind == "write" else p.read is None):
                            continue
                        if kind == "warm" and not p.warm:
                            continue
                        if kind == "write":
                            if p is raw:
                                continue
                            try:
                                t_raw, t_p = self.write_pair(raw, p, rep + i)
                            except Exception as e:  # noqa: BLE001 - say why, keep the rest
                                p.note = f"cannot run: {type(e).__name__}: {e}"[:100]
                                continue
                            raw.times[kind].append(t_raw)
                            p.times[kind].append(t_p)
                            p.ratios.setdefault(kind, []).append(t_raw / t_p)
                            continue
                        pair = [raw, p] if (rep + i) % 2 == 0 else [p, raw]
                        got = {}
                        for q in pair:
                            try:
                                got[q.name] = self.read_pass(q, kind)
                            except OSError as e:
                                if "O_DIRECT" in q.name and e.errno == errno.EINVAL:
                                    q.note = f"refused by the filesystem ({e.strerror})"
                                    break
                                raise
                            except Exception as e:  # noqa: BLE001 - say why, keep the rest
                                if q is raw:
                                    raise
                                q.note = f"cannot run: {type(e).__name__}: {e}"[:100]
                                break
                        if len(got) < len(set(x.name for x in pair)):
                            continue
                        raw.times[kind].append(got[raw.name])
                        if p is not raw:
                            p.times[kind].append(got[p.name])
                            p.ratios.setdefault(kind, []).append(got[raw.name] / got[p.name])

    def gbps(self, p: Path, kind: str) -> float | None:
        t = p.times[kind]
        return self.total / statistics.median(t) / 1e9 if t else None

    def split(self) -> str:
        """Per page: the checksum, the MAC and a plain copy, for the time split."""
        import torch

        from vllm_kvbm.tiers import page_checksum
        from vllm_kvbm.tiers.page_codec import PageCodec
        from vllm_kvbm.tiers.page_format import copy_bytes

        page = self.pages[0]
        dst = torch.empty_like(page)

        def per_page(fn, reps=50):
            fn()
            return min(timed(lambda: [fn() for _ in range(reps)]) for _ in range(3)) / reps

        crc = per_page(lambda: page_checksum.checksum(page_checksum.WRITE_ALG, b"", page))
        codec = PageCodec("bench", self.block, os.urandom(32))
        sealed = memoryview(torch.empty_like(page).numpy())

        def seal():  # as a sealed write computes it: encrypt, checksum, tag
            signer = codec.signer(bytes(32))
            signer.seal(memoryview(page.numpy()), sealed)
            signer.header()

        t_mac = per_page(seal)
        copy = per_page(lambda: copy_bytes(dst, page))
        raw = self.gbps(self.paths[0], "warm")
        t_raw = self.stored / (raw * 1e9) if raw else float("nan")
        return (
            f"per page: raw warm read {t_raw * 1e6:.0f} us, {page_checksum.checksum_name()} "
            f"{crc * 1e6:.0f} us, "
            f"page seal (AES-256-GCM) {t_mac * 1e6:.0f} us, memcpy {copy * 1e6:.0f} us"
        )

    def report(self) -> bool:
        print(
            f"\n{self.n} pages of {self.block / MiB:g} MiB (+{self.header} B header) = "
            f"{self.total / MiB:.0f} MiB in {self.root}"
        )
        print(
            f"filesystem: {fs_type(self.root)}; cold = {self.cache.how}; median of "
            f"{self.args.reps} passes, each next to a raw 1 file pass; page MAC: "
            f"{'on' if self.secret else 'off'}"
        )
        print(self.split())
        cols = ["write", "warm", "cold"]
        print(f"\n{'path':<36}" + "".join(f"{c + ' GB/s':>12}{'x raw':>7}" for c in cols))
        for p in self.paths:
            line = f"{p.name:<36}"
            for c in cols:
                v = self.gbps(p, c)
                line += f"{'-':>12}{'':>7}" if v is None else f"{v:>12.2f}{self.ratio(p, c):>7.2f}"
            print(line + (f"  {p.note}" if p.note else ""))
        print(
            f"\nbars (against raw 1 file): read >= {READ_BAR}x (warm and cold), "
            f"write >= {WRITE_BAR}x; the tier as TierIO drives it:"
        )
        ok = True
        bars = [
            (
                f"DiskStore, {self.args.inflight} in flight",
                "write",
                WRITE_BAR,
                "writes (TierIO's writers)",
            ),
            (
                f"DiskStore, {self.args.inflight} in flight",
                "warm",
                READ_BAR,
                "warm reads (get_many_into)",
            ),
            (
                f"DiskStore, {self.args.inflight} in flight",
                "cold",
                READ_BAR,
                "cold reads (get_many_into)",
            ),
        ]
        for name, c, bar, what in bars:
            [p] = [q for q in self.paths if q.name == name]
            r = self.ratio(p, c)
            ok &= r >= bar
            print(f"  {what:<28} {r:.2f}x  {'PASS' if r >= bar else 'FAIL'}")
        return ok

    def ratio(self, p: Path, kind: str) -> float:
        if p is self.paths[0]:
            return 1.0
        r = p.ratios.get(kind)
        return statistics.median(r) if r else float("nan")

    def close(self) -> None:
        for p in self.paths:
            p.close()
        self.pool.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: system tmp)")
    ap.add_argument("--block-mib", type=float, default=2.0, help="page payload size")
    ap.add_argument("--total-mib", type=float, default=512.0, help="bytes of payload per pass")
    ap.add_argument("--inflight", type=int, default=4, help="pages in flight on the pool paths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--secret", action="store_true", help="pages carry a MAC (page secret)")
    ap.add_argument("--skip", default="", help="comma-separated: lmcache,nixl,direct")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    b = Bench(args)
    try:
        b.raw_one_file()
        b.raw_per_page()
        b.raw_odirect()
        b.disk_store(inflight=False)
        b.disk_store(inflight=True)
        if "lmcache" not in skip:
            b.lmcache_local_disk()
        if "nixl" not in skip:
            b.lmcache_nixl()
        if "direct" not in skip:
            b.direct_reads()
        b.run()
        ok = b.report()
    finally:
        b.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
