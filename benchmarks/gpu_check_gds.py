"""The "gds" case of benchmarks/gpu_check.py: a file read into GPU memory.

NIXL reading a file straight into GPU memory through cuFile (the GDS and
GDS_MT plugins) against a plain read into pinned host memory plus ``copy_``
to the GPU, both from a cold page cache, bytes checked. Where there is no
cuFile (libcufile) or no CUDA device the GDS rows say why they were
skipped; NIXL's POSIX plugin reading the same file into host memory is
checked everywhere (it is what runs on CPU).
"""

from __future__ import annotations

import ctypes.util
import glob
import json
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import torch

from helpers.kv_layouts import agent_name

if TYPE_CHECKING:
    from gpu_check_harness import Report


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def find_cufile() -> str | None:
    """Path of cuFile's library (libcufile.so.0): the system's, or the one the
    nvidia-cufile wheel beside PyTorch carries; None where there is none."""
    found = ctypes.util.find_library("cufile")
    candidates = [found] if found else []
    for base in sys.path:
        candidates += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcufile.so*")))
        candidates += sorted(
            glob.glob(os.path.join(base, "nvidia", "cufile", "lib", "libcufile.so*"))
        )
    candidates += sorted(glob.glob("/usr/local/cuda*/lib64/libcufile.so*"))
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # NIXL's GDS plugin then finds it
            return path
        except OSError:
            continue
    return None


def drop_cache(fd: int) -> None:
    """Evicts the file's pages from the page cache, so the next read is cold."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def open_direct(path: str) -> tuple[int, bool]:
    """The file opened for reading, with O_DIRECT where its filesystem allows."""
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDWR), False


def aligned_empty(n: int, pin: bool) -> torch.Tensor:
    """n bytes of host memory starting on a 4 KiB boundary (O_DIRECT reads need it)."""
    raw = torch.empty(n + 4096, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % 4096
    return raw[skip : skip + n]


def nixl_file_read(
    agent, backend: str, fd: int, dst: torch.Tensor, name: str, timeout_s: float
) -> tuple[str, float]:
    """NIXL reads the file (from offset 0) into ``dst`` with ``backend``:
    (state, seconds from posting to done)."""
    n = dst.numel()
    file_reg = agent.register_memory([(0, n, fd, "")], "FILE", backends=[backend])
    mem_reg = agent.register_memory(dst, backends=[backend])
    try:
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(dst),
            agent.get_xfer_descs([(0, n, fd)], "FILE"),
            name,
            backends=[backend],
        )
        try:
            t = time.perf_counter()
            try:
                state = agent.transfer(handle)
                while state == "PROC":
                    if time.perf_counter() - t > timeout_s:
                        return "TIMEOUT", float("inf")
                    state = agent.check_xfer_state(handle)
            except Exception as err:  # noqa: BLE001 - NIXL raises on a failed transfer
                return f"ERR ({type(err).__name__}: {err})", float("inf")
            return state, time.perf_counter() - t
        finally:
            agent.release_xfer_handle(handle)
    finally:
        agent.deregister_memory(mem_reg, backends=[backend])
        agent.deregister_memory(file_reg, backends=[backend])


def plain_read_seconds(fd: int, dst: torch.Tensor, chunk: int) -> float:
    """A plain read of the file into pinned host memory, ``copy_`` to ``dst``
    chunk by chunk (two host buffers: a chunk's copy overlaps the next read)."""
    cuda = dst.device.type == "cuda"
    bufs = [aligned_empty(chunk, cuda) for _ in range(2)]
    events = [None, None]
    t = time.perf_counter()
    off, i = 0, 0
    while off < dst.numel():
        buf = bufs[i % 2]
        if events[i % 2] is not None:
            events[i % 2].synchronize()
        want = min(chunk, dst.numel() - off)
        got = os.preadv(fd, [memoryview(buf.numpy())[:want]], off)
        if got != want:
            raise OSError(f"short read: {got} of {want} bytes at {off}")
        dst[off : off + want].copy_(buf[:want], non_blocking=cuda)
        if cuda:
            events[i % 2] = torch.cuda.Event()
            events[i % 2].record()
        off, i = off + want, i + 1
    sync(dst.device)
    return time.perf_counter() - t


def run_gds(args, device: torch.device, report: Report) -> None:
    """A file read into GPU memory by NIXL's GDS plugins (cuFile) against a
    plain read plus copy_; NIXL's POSIX plugin into host memory everywhere."""
    name, n = "gds", args.gds_mib << 20
    cuda = device.type == "cuda"
    cufile = find_cufile() if cuda else None
    nvfs = sorted(glob.glob("/dev/nvidia-fs*")) or os.path.exists("/proc/driver/nvidia-fs")
    work = tempfile.mkdtemp(prefix="kvbm-gds-", dir=args.gds_dir)
    path = os.path.join(work, "pages.bin")
    if cufile and "CUFILE_ENV_PATH_JSON" not in os.environ:
        # cuFile reads through the host where the kernel has no GDS driver
        # (nvidia-fs): "compat mode". Its log goes beside the file, not the cwd.
        conf = os.path.join(work, "cufile.json")
        with open(conf, "w") as f:
            json.dump(
                {
                    "logging": {"dir": work, "level": "ERROR"},
                    "properties": {"allow_compat_mode": True},
                },
                f,
            )
        os.environ["CUFILE_ENV_PATH_JSON"] = conf
    from vllm_kvbm.worker.page_mover import _nixl_api

    nixl_agent, nixl_agent_config, module = _nixl_api()
    agent_id = agent_name("kvbm-gds-check")
    agent = nixl_agent(agent_id, nixl_agent_config(backends=[]))
    plugins = agent.get_plugin_list()
    fd = -1
    try:
        want = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        with open(path, "wb") as f:
            f.write(memoryview(want.cpu().numpy()))
        fd, direct = open_direct(path)
        report.info(
            name,
            "file",
            f"{n / 2**20:.0f} MiB at {path} (O_DIRECT: {direct}); "
            f"{module} plugins {', '.join(plugins)}",
        )

        # NIXL's POSIX plugin into host memory: the file path the GDS rows share
        host = aligned_empty(n, cuda).zero_()
        agent.create_backend("POSIX")
        drop_cache(fd)
        state, secs = nixl_file_read(agent, "POSIX", fd, host, agent_id, args.timeout)
        ok = state == "DONE" and torch.equal(host, want.cpu())
        report.check(
            name,
            "NIXL POSIX file -> host, bytes equal",
            ok,
            f"{state}; {n / secs / 1e9:.2f} GB/s cold" if state == "DONE" else state,
        )
        del host

        dst = torch.zeros(n, dtype=torch.uint8, device=device)
        best_plain = float("inf")
        for _ in range(args.repeats):
            dst.zero_()
            drop_cache(fd)
            best_plain = min(best_plain, plain_read_seconds(fd, dst, 64 << 20))
        report.check(
            name,
            f"plain read + copy_ -> {'GPU' if cuda else 'CPU'}, bytes equal",
            torch.equal(dst, want),
            f"{n / best_plain / 1e9:.2f} GB/s cold (best of {args.repeats})",
        )
        if not cuda:
            report.info(name, "GDS disk -> GPU", "skipped: no CUDA device (CPU run)")
            return
        if cufile is None:
            report.info(
                name,
                "GDS disk -> GPU",
                "skipped: no libcufile (cuFile) found on this "
                "machine (nvidia-cufile wheel or CUDA toolkit)",
            )
            return
        report.info(
            name,
            "cuFile",
            f"{cufile}; nvidia-fs driver: "
            f"{'present' if nvfs else 'absent (cuFile compat mode: through host memory)'}",
        )
        for backend in ("GDS", "GDS_MT"):
            what = f"NIXL {backend} file -> GPU"
            if backend not in plugins:
                report.info(name, what, f"skipped: {module} has no {backend} plugin")
                continue
            try:
                agent.create_backend(backend)
            except Exception as err:  # noqa: BLE001 - cuFile refused: say why, go on
                report.info(
                    name,
                    what,
                    f"skipped: {backend} backend did not start: {type(err).__name__}: {err}",
                )
                continue
            best, state = float("inf"), "DONE"
            for _ in range(args.repeats):
                dst.zero_()
                sync(device)
                drop_cache(fd)
                state, secs = nixl_file_read(agent, backend, fd, dst, agent_id, args.timeout)
                if state != "DONE":
                    break
                best = min(best, secs)
            sync(device)
            if state != "DONE":  # the machine's cuFile setup, not KVBM (which reads no GDS)
                report.info(name, what, f"did not complete: {state}")
                continue
            report.check(
                name,
                f"{what}, bytes equal",
                torch.equal(dst, want),
                f"{n / best / 1e9:.2f} GB/s cold ({best_plain / best:.2f}x the plain read + copy_)",
            )
    finally:
        if fd >= 0:
            os.close(fd)
        for f in glob.glob(os.path.join(work, "*")):
            os.unlink(f)
        os.rmdir(work)
