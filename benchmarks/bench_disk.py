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
import ctypes
import errno
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

MiB = 1024 * 1024
ALIGN = 4096
READ_BAR, WRITE_BAR = 0.9, 0.7
# Pages each side of a write comparison writes before the other's turn.
WRITE_BATCH = 8


# ------------------------------------------------------------------ helpers

def aligned_u8(n: int):
    """A page-aligned uint8 tensor of n bytes (anonymous mmap), for O_DIRECT."""
    import torch

    m = mmap.mmap(-1, max(n, 1))
    t = torch.frombuffer(m, dtype=torch.uint8, count=n)
    t._keep = m  # the mapping lives as long as the tensor
    return t


def view_of(t) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (keep t alive)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


class Cache:
    """Drops the page cache before a cold pass: drop_caches or fadvise."""

    def __init__(self):
        self.global_drop = can_drop_caches()
        self.how = ("echo 1 > /proc/sys/vm/drop_caches" if self.global_drop
                    else "posix_fadvise(POSIX_FADV_DONTNEED) per file")

    def drop(self, paths) -> None:
        os.sync()  # dirty pages cannot be dropped
        if self.global_drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(paths) -> None:
    """Puts every file in the page cache as writing it leaves it: its bytes
    read, its cached pages dropped, the same bytes written back 1 MiB per
    call (as the tier writes), then synced (clean, not written again).

    Not by reading the files: a page cache filled by readahead of 2 MiB files
    was 1.4x slower to copy out than the same bytes filled by readahead of
    one big file (read_ahead_kb 8192 here; most likely smaller folios), while
    filled by writes both read at the same speed. The tier's warm pages are
    written ones: its spills leave them there, and a page none of which is
    cached is read with O_DIRECT, which does not fill the cache."""
    seg = 64 * MiB
    for p in paths:
        fd = os.open(p, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for start in range(0, size, seg):
                data = os.pread(fd, min(seg, size - start), start)
                os.fdatasync(fd)
                os.posix_fadvise(fd, start, len(data), os.POSIX_FADV_DONTNEED)
                for off in range(0, len(data), MiB):
                    os.pwrite(fd, data[off:off + MiB], start + off)
        finally:
            os.close(fd)
    os.sync()


def files_in(d: str) -> list[str]:
    return [os.path.join(d, f) for f in os.listdir(d) if not f.startswith(".")]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_all(fd: int, view: memoryview, offset: int = 0) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


# -------------------------------------------------------------------- paths

class Path:
    """One way of writing and reading the pages: write() (None: reads another
    path's files), read() (None: write only), files() (what a cold pass drops)."""

    def __init__(self, name, write=None, read=None, files=None, warm=True, close=None,
                 prepare=None, finish=None):
        self.name, self.write, self.read, self.files = name, write, read, files
        # Untimed, before each write pass: an empty directory (and a fresh
        # store), so a pass times the writes alone, not deleting the last
        # pass's files or starting a store.
        self.prepare = prepare or (lambda: None)
        self.finish = finish or (lambda: None)  # after a write pass, untimed
        self.warm = warm  # False: O_DIRECT, the page cache is never used
        self.close = close or (lambda: None)
        self.times = {"write": [], "warm": [], "cold": []}
        self.ratios: dict[str, list[float]] = {}  # to raw, pass by adjacent pass
        self.note = ""


class Bench:
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

    # -- raw -----------------------------------------------------------------
    def raw_one_file(self) -> None:
        path = os.path.join(self.fresh("raw1"), "all.bin")
        hdr = bytes(self.header)

        fd = [-1]

        def prepare():
            if os.path.exists(path):
                os.remove(path)
            fd[0] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        def write(pages):  # appended in order: one sequential file
            for i in pages:
                os.writev(fd[0], [hdr, self.page_views[i]])

        def finish():
            os.close(fd[0])

        def read():
            hbuf = bytearray(self.header)
            with open(path, "rb", buffering=0) as f:
                for sv in self.slot_views:
                    f.readinto(hbuf)
                    f.readinto(sv)

        self.raw1_path = path
        self.paths.append(Path("raw 1 file", write, read, lambda: [path], prepare=prepare,
                               finish=finish))

    def raw_per_page(self) -> None:
        d = self.fresh("rawN")
        paths = [os.path.join(d, f"p{i}.bin") for i in range(self.n)]
        hdr = bytes(self.header)

        def prepare():
            for p in paths:
                if os.path.exists(p):
                    os.remove(p)

        def write(pages):
            for i in pages:
                fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.writev(fd, [hdr, self.page_views[i]])
                finally:
                    os.close(fd)

        def read():
            hbuf = bytearray(self.header)
            for p, sv in zip(paths, self.slot_views):
                with open(p, "rb", buffering=0) as f:
                    f.readinto(hbuf)
                    f.readinto(sv)

        self.paths.append(Path("raw per page", write, read, lambda: paths, prepare=prepare))

    def raw_odirect(self) -> None:
        """Raw O_DIRECT reads of the big file, 16 MiB at a time (no page cache)."""
        path = self.raw1_path
        chunk = 16 * MiB
        buf = aligned_u8(chunk)
        bv = view_of(buf)

        def read(buf=buf):  # holds the mapping bv points into
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                off = 0
                while off < self.total:
                    n = os.preadv(fd, [bv], off)
                    if n <= 0:
                        break
                    off += n
            finally:
                os.close(fd)

        self.paths.append(Path("raw 1 file O_DIRECT", None, read, lambda: [path], warm=False))

    # -- the tier ------------------------------------------------------------
    def disk_store(self, inflight: bool) -> None:
        from vllm_kvbm.tiers.disk.store import DiskStore

        k = self.args.inflight
        label = f"DiskStore, {k} in flight" if inflight else "DiskStore, 1 at a time"
        state = {}
        d = os.path.join(self.root, "tier-many" if inflight else "tier-one")

        def close():
            if "s" in state:
                state.pop("s").close()

        def prepare():
            close()
            shutil.rmtree(d, ignore_errors=True)
            state["s"] = DiskStore(d, 2 * self.total + 64 * MiB, self.block, "bench", 0, 1,
                                   page_secret=self.secret, read_inflight=k)

        def put_all(pages):
            s = state["s"]
            if inflight:  # puts from k threads
                ok = list(self.pool.map(lambda i: s.put(self.keys[i], self.pages[i]), pages))
            else:  # one thread
                ok = [s.put(self.keys[i], self.pages[i]) for i in pages]
            if not all(ok):
                raise RuntimeError("DiskStore.put refused a page")

        def get_all():
            s = state["s"]
            if inflight:  # get_many_into: reads on the store's own readers
                got = s.get_many_into(list(zip(self.keys, self.slots)))
            else:
                got = [s.get_into(k_, slot) for k_, slot in zip(self.keys, self.slots)]
            if any(g != "ok" for g in got):
                raise RuntimeError(f"DiskStore.get_into: {set(got)}")

        def files():
            s = state["s"]
            return [s._disk._key_to_path(s._ckey(k_)) for k_ in self.keys]

        if not inflight:
            self.tier_files = files
        self.paths.append(Path(label, put_all, get_all, files, close=close, prepare=prepare))

    # -- LMCache's own disk backends -------------------------------------------
    @staticmethod
    def lmcache_backend(d: str, md, thread_name: str, make):
        """(open, state, close) for an LMCache backend writing to ``d``: open(cfg)
        starts afresh (an empty ``d``), starts its event loop and
        staging, and makes the backend with make(cfg, loop, staging); state["b"]
        holds (loop, thread, staging, backend) until close()."""
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        from vllm_kvbm.tiers.lmcache_store import start_loop, stop_loop

        state = {}

        def close():
            if "b" in state:
                loop, thread, staging, backend = state.pop("b")
                backend.close()
                stop_loop(loop, thread, 5.0)
                staging.close()

        def open_(cfg):
            close()
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            loop, thread = start_loop(thread_name)
            staging = LocalCPUBackend(cfg, md)
            state["b"] = (loop, thread, staging, make(cfg, loop, staging))
            return state["b"][2], state["b"][3]
        return open_, state, close

    # -- LMCache LocalDiskBackend, as the tier used it ------------------------
    def lmcache_local_disk(self) -> None:
        import torch
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        from vllm_kvbm.tiers.lmcache_store import GIB, LMCacheStore
        from vllm_kvbm.tiers.page_format import flat_u8

        base = LMCacheStore(self.block, "bench-lm", 0, 1, self.secret)
        d = os.path.join(self.root, "lmdisk")
        open_, state, close = self.lmcache_backend(
            d, base._md, "bench-lmdisk", lambda cfg, loop, staging: LocalDiskBackend(
                cfg, loop, staging, dst_device="cpu", metadata=base._md))

        def prepare():
            # Staging as the tier had it: max_inflight (8) + 2 pages.
            open_(base._Config.from_defaults(
                chunk_size=1, local_cpu=False,
                max_local_cpu_size=(10 * base._phys + 8 * MiB) / GIB,
                local_disk=d, max_local_disk_size=2 * self.total / GIB))

        def write(pages):
            _, _, staging, disk = state["b"]
            for k, p in [(self.keys[i], self.pages[i]) for i in pages]:  # one at a time
                done = threading.Event()
                mo = staging.allocate(base._shape, torch.uint8, base._fmt, busy_loop=True)
                base._codec.encode_into(flat_u8(mo.tensor), k, p)
                disk.submit_put_task(base._ckey(k), mo,
                                     on_complete_callback=lambda *_: done.set())
                mo.ref_count_down()
                if not done.wait(60):
                    raise RuntimeError("LocalDiskBackend write never finished")

        def read():
            disk = state["b"][3]
            for i, k in enumerate(self.keys):
                mo = disk.get_blocking(base._ckey(k))
                try:
                    st = base._codec.decode_into(flat_u8(mo.tensor), k, self.slots[i])
                finally:
                    mo.ref_count_down()
                if st != "ok":
                    raise RuntimeError(f"LocalDiskBackend page {st}")

        self.paths.append(Path("LMCache LocalDiskBackend", write, read,
                               lambda: files_in(d), close=close, prepare=prepare))

    # -- LMCache NixlStorageBackend (NIXL POSIX) -------------------------------
    def lmcache_nixl(self) -> None:
        import torch

        from vllm_kvbm.tiers.lmcache_store import GIB, LMCacheStore
        from vllm_kvbm.tiers.page_format import flat_u8

        label = "LMCache NixlStorageBackend (POSIX)"
        path = Path(label)
        self.paths.append(path)
        try:
            from lmcache.v1.storage_backend.nixl_storage_backend import NixlStorageBackend
        except Exception as e:  # noqa: BLE001
            path.note = f"cannot run: {e}"
            return
        base = LMCacheStore(self.block, "bench-nixl", 0, 1, self.secret)
        d = os.path.join(self.root, "nixl")
        open_, state, close = self.lmcache_backend(
            d, base._md, "bench-nixl", lambda cfg, loop, staging:
            NixlStorageBackend.CreateNixlStorageBackend(cfg, loop, base._md, staging))

        def prepare():
            # Staging for every page at once: its gets are batched, so every
            # page is in flight in one NIXL transfer.
            open_(base._Config.from_defaults(
                chunk_size=1, local_cpu=False, max_local_cpu_size=(self.n + 2) * self.stored / GIB,
                nixl_buffer_device="cpu",
                extra_config={"enable_nixl_storage": True, "nixl_backend": "POSIX",
                              "nixl_pool_size": self.n, "nixl_path": d, "use_direct_io": False}))

        def write(pages):
            _, _, staging, nixl = state["b"]
            ckeys = [base._ckey(self.keys[i]) for i in pages]
            batch = []
            for k, p in [(self.keys[i], self.pages[i]) for i in pages]:
                mo = staging.allocate(base._shape, torch.uint8, base._fmt, busy_loop=False)
                base._codec.encode_into(flat_u8(mo.tensor), k, p)
                batch.append(mo)
            nixl.batched_submit_put_task(ckeys, batch)
            for mo in batch:
                mo.ref_count_down()
            deadline = time.monotonic() + 120
            while not all(nixl.contains(ck) for ck in ckeys):
                if time.monotonic() > deadline:
                    raise RuntimeError("NIXL puts never finished")
                time.sleep(0.001)

        def read():
            nixl = state["b"][3]
            got = nixl.batched_get_blocking([base._ckey(k) for k in self.keys])
            try:
                for i, (k, mo) in enumerate(zip(self.keys, got)):
                    if mo is None:
                        raise RuntimeError("NIXL get returned nothing")
                    st = base._codec.decode_into(flat_u8(mo.tensor), k, self.slots[i])
                    if st != "ok":
                        raise RuntimeError(f"NIXL page {st}")
            finally:
                for mo in got:
                    if mo is not None:
                        mo.ref_count_down()

        path.write, path.read, path.files, path.close = write, read, lambda: files_in(d), close
        path.prepare = prepare

    # -- direct reads into host slots -----------------------------------------
    def direct_reads(self) -> None:
        """The tier's page files (DiskStore, 1 at a time) read by bare syscalls:
        what the tier's reads cost without its checks and bookkeeping."""
        k = self.args.inflight
        # The tier's file names, computed once per pass (not once per page).
        files: list[str] = []

        def passing(read):
            def run():
                files[:] = self.tier_files()
                read()
            return run

        def one(i):
            hdr = bytearray(self.header)
            fd = os.open(files[i], os.O_RDONLY | os.O_NOFOLLOW)
            try:
                n = os.preadv(fd, [hdr, self.slot_views[i]], 0)
            finally:
                os.close(fd)
            if n != self.stored:
                raise RuntimeError("short read")

        def serial():
            for i in range(self.n):
                one(i)

        def many():
            list(self.pool.map(one, range(self.n)))

        self.paths.append(Path("preadv into slots, 1 at a time", None, passing(serial),
                               self.tier_files))
        self.paths.append(Path(f"preadv into slots, {k} in flight", None, passing(many),
                               self.tier_files))

        # O_DIRECT: the whole file into an aligned bounce buffer, then the payload
        # to the slot (the header puts the payload off the 4 KiB alignment).
        span = -(-self.stored // ALIGN) * ALIGN
        local = threading.local()

        def one_direct(i):
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = aligned_u8(span)
                local.view = view_of(buf)
            fd = os.open(files[i], os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECT)
            try:
                n = os.preadv(fd, [local.view], 0)
            finally:
                os.close(fd)
            if n != self.stored:
                raise RuntimeError("short read")
            ctypes.memmove(self.slots[i].data_ptr(), buf.data_ptr() + self.header, self.block)

        self.paths.append(Path(f"O_DIRECT + copy, {k} in flight", None,
                               passing(lambda: list(self.pool.map(one_direct, range(self.n)))),
                               self.tier_files, warm=False))

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
            for q in ((raw, p) if (rep + j) % 2 == 0 else (p, raw)):
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
        return (f"per page: raw warm read {t_raw * 1e6:.0f} us, {page_checksum.checksum_name()} "
                f"{crc * 1e6:.0f} us, "
                f"page seal (AES-256-GCM) {t_mac * 1e6:.0f} us, memcpy {copy * 1e6:.0f} us")

    def report(self) -> bool:
        print(f"\n{self.n} pages of {self.block / MiB:g} MiB (+{self.header} B header) = "
              f"{self.total / MiB:.0f} MiB in {self.root}")
        print(f"filesystem: {fs_type(self.root)}; cold = {self.cache.how}; median of "
              f"{self.args.reps} passes, each next to a raw 1 file pass; page MAC: "
              f"{'on' if self.secret else 'off'}")
        print(self.split())
        cols = ["write", "warm", "cold"]
        print(f"\n{'path':<36}" + "".join(f"{c + ' GB/s':>12}{'x raw':>7}" for c in cols))
        for p in self.paths:
            line = f"{p.name:<36}"
            for c in cols:
                v = self.gbps(p, c)
                line += f"{'-':>12}{'':>7}" if v is None else f"{v:>12.2f}{self.ratio(p, c):>7.2f}"
            print(line + (f"  {p.note}" if p.note else ""))
        print(f"\nbars (against raw 1 file): read >= {READ_BAR}x (warm and cold), "
              f"write >= {WRITE_BAR}x; the tier as TierIO drives it:")
        ok = True
        bars = [(f"DiskStore, {self.args.inflight} in flight", "write", WRITE_BAR,
                 "writes (TierIO's writers)"),
                (f"DiskStore, {self.args.inflight} in flight", "warm", READ_BAR,
                 "warm reads (get_many_into)"),
                (f"DiskStore, {self.args.inflight} in flight", "cold", READ_BAR,
                 "cold reads (get_many_into)")]
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


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{fs} ({dev} on {mnt})"
    return kind


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
