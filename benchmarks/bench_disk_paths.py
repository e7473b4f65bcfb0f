"""The ways of writing and reading the pages that benchmarks/bench_disk.py
compares (raw files, the disk tier, LMCache's disk backends, direct reads),
each added to the bench's ``paths`` by a method of ``DiskPaths``."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time

from bench_disk_io import ALIGN, MiB, Path, aligned_u8, files_in, view_of


def page_format_of(block: int, namespace: str, secret: bytes | None):
    """The tier's page format and LMCache keys (an LMCacheStore's codec, key and
    metadata) for driving LMCache's own backends; the store's methods are unused."""
    from vllm_kvbm.tiers.lmcache_store import LMCacheStore

    class PageFormat(LMCacheStore):
        put = get_into = contains = remove = close = None  # not a store: LMCache's backend is

    return PageFormat(block, namespace, 0, 1, secret)


class DiskPaths:
    """Mixed into bench_disk.Bench: its pages, slots, keys, pool and root."""

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
        self.paths.append(
            Path("raw 1 file", write, read, lambda: [path], prepare=prepare, finish=finish)
        )

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
            state["s"] = DiskStore(
                d,
                2 * self.total + 64 * MiB,
                self.block,
                "bench",
                0,
                1,
                page_secret=self.secret,
                read_inflight=k,
            )

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

        from vllm_kvbm.tiers.lmcache_store import GIB
        from vllm_kvbm.tiers.page_format import flat_u8

        base = page_format_of(self.block, "bench-lm", self.secret)
        d = os.path.join(self.root, "lmdisk")
        open_, state, close = self.lmcache_backend(
            d,
            base._md,
            "bench-lmdisk",
            lambda cfg, loop, staging: LocalDiskBackend(
                cfg, loop, staging, dst_device="cpu", metadata=base._md
            ),
        )

        def prepare():
            # Staging as the tier had it: max_inflight (8) + 2 pages.
            open_(
                base._Config.from_defaults(
                    chunk_size=1,
                    local_cpu=False,
                    max_local_cpu_size=(10 * base._phys + 8 * MiB) / GIB,
                    local_disk=d,
                    max_local_disk_size=2 * self.total / GIB,
                )
            )

        def write(pages):
            _, _, staging, disk = state["b"]
            for k, p in [(self.keys[i], self.pages[i]) for i in pages]:  # one at a time
                done = threading.Event()
                mo = staging.allocate(base._shape, torch.uint8, base._fmt, busy_loop=True)
                base._codec.encode_into(flat_u8(mo.tensor), k, p)
                disk.submit_put_task(base._ckey(k), mo, on_complete_callback=lambda *_: done.set())
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

        self.paths.append(
            Path(
                "LMCache LocalDiskBackend",
                write,
                read,
                lambda: files_in(d),
                close=close,
                prepare=prepare,
            )
        )

    # -- LMCache NixlStorageBackend (NIXL POSIX) -------------------------------
    def lmcache_nixl(self) -> None:
        import torch

        from vllm_kvbm.tiers.lmcache_store import GIB
        from vllm_kvbm.tiers.page_format import flat_u8

        label = "LMCache NixlStorageBackend (POSIX)"
        path = Path(label)
        self.paths.append(path)
        try:
            from lmcache.v1.storage_backend.nixl_storage_backend import NixlStorageBackend
        except Exception as e:  # noqa: BLE001
            path.note = f"cannot run: {e}"
            return
        base = page_format_of(self.block, "bench-nixl", self.secret)
        d = os.path.join(self.root, "nixl")
        open_, state, close = self.lmcache_backend(
            d,
            base._md,
            "bench-nixl",
            lambda cfg, loop, staging: NixlStorageBackend.CreateNixlStorageBackend(
                cfg, loop, base._md, staging
            ),
        )

        def prepare():
            # Staging for every page at once: its gets are batched, so every
            # page is in flight in one NIXL transfer.
            open_(
                base._Config.from_defaults(
                    chunk_size=1,
                    local_cpu=False,
                    max_local_cpu_size=(self.n + 2) * self.stored / GIB,
                    nixl_buffer_device="cpu",
                    extra_config={
                        "enable_nixl_storage": True,
                        "nixl_backend": "POSIX",
                        "nixl_pool_size": self.n,
                        "nixl_path": d,
                        "use_direct_io": False,
                    },
                )
            )

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

        self.paths.append(
            Path("preadv into slots, 1 at a time", None, passing(serial), self.tier_files)
        )
        self.paths.append(
            Path(f"preadv into slots, {k} in flight", None, passing(many), self.tier_files)
        )

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

        self.paths.append(
            Path(
                f"O_DIRECT + copy, {k} in flight",
                None,
                passing(lambda: list(self.pool.map(one_direct, range(self.n)))),
                self.tier_files,
                warm=False,
            )
        )
