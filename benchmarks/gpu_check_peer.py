"""The "peer-read" case of benchmarks/gpu_check.py: a peer's pages read into pinned host memory, then onto the GPU.

What an engine with ``peer_reads`` does with a peer's pages, between two
processes on this machine: a pool file of ``--peer-pages`` pages (random
bytes, 4 MiB each by default) is written under /dev/shm (or the temp dir
where /dev/shm is too small) and served by a real ``kvbm-pool`` process (its
NIXL agent and control endpoint). This process's reader, a ``PeerStore``
used through its public methods, reads every page with ``get_many_into``
into host memory pinned with ``cudaHostRegister`` by the host tier's own
helper (worker/host_pool.py's ``HostPool``); each page is checked by the
reader (key, scope, CRC) and compared with the bytes served, then the pages
are copied to the GPU with ``copy_`` and compared there. Rows:

- the host memory pinned (on CUDA; a CPU run says pinning is skipped);
- the reader's path: where the PeerStore has ``reads_into`` (as the host
  tier's slots are registered with it), pages are READ in place into that
  memory; else through its landing slots and copied;
- every page "ok" and byte-equal to the served page, in every round;
- peer read GB/s against one raw NIXL READ of as many slots of the same
  file on the same transport (UCX's; ``--peer-ucx-tls`` picks one), after
  the same ``hello``: the ratio says what the reader costs on top of the
  transport. Both are timed by perf_counter from the post until polled
  done (a host-to-host read: the GPU takes no part), medians of
  ``--repeats`` rounds after a first one that sets up the connection;
- the pages copied to the GPU equal the served pages, with the copy's GB/s
  timed by CUDA events (a CPU run says the GPU copy is skipped).

Everything runs in a child process (this file with ``--child``, started with
``start_new_session``) that starts ``kvbm-pool`` in its process group: a NIXL or UCX
failure or hang ends only this case, and the parent kills both at the
case's deadline. The child
prints its rows as tab-separated lines; the parent reports them as they
come (gpu_check_vllm.report_child), and removes the pool file's directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_vllm import report_child
from pool_process import pool_hello, start_pool

NAME = "peer-read"
REPO = Path(__file__).resolve().parent.parent
NS = "gpu-check-peer"
CASE_S = 90.0  # at most, of the check's budget
MIN_S = 20.0  # less of the budget left: skipped
MAX_PAGES = 32  # of the probe's sizing
_KEPT: list = []  # what a READ still in flight may write into
# Imported by the reader and kvbm-pool beyond PyTorch, NIXL and numpy (the peer
# tier's control link; a dependency of vllm_kvbm and of vLLM): module -> package.
NEEDS = {"zmq": "pyzmq"}


def peer_pages(target_bytes: int, page_kib: int) -> int:
    """Pages of the case for the probe's bytes per transfer: 4 to MAX_PAGES."""
    return max(4, min(MAX_PAGES, target_bytes // (page_kib << 10)))


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pool_dir(need: int) -> str:
    """/dev/shm where it has room for ``need`` bytes with a margin (a container's
    is 64 MiB by default), else the temp dir."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2 * need and os.access("/dev/shm", os.W_OK):
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def run_peer(args, device, report, deadline: float) -> None:
    """Runs the child and reports its rows as they come."""
    missing = [pkg for mod, pkg in NEEDS.items() if not _found(mod)]
    if missing:
        report.info(
            NAME,
            "skipped",
            f"not installed here: {', '.join(missing)} (a dependency "
            f"of vllm_kvbm and vLLM: pip install {' '.join(missing)})",
        )
        return
    left = deadline - time.perf_counter()
    if left < MIN_S:
        report.info(NAME, "skipped", "too little of the time budget is left")
        return
    page_bytes = args.peer_page_kib << 10
    work = tempfile.mkdtemp(
        prefix="kvbm-gpu-check-peer-", dir=pool_dir(5 * args.peer_pages * page_bytes)
    )
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--device",
        device.type,
        "--dir",
        work,
        "--pages",
        str(args.peer_pages),
        "--page-kib",
        str(args.peer_page_kib),
        "--repeats",
        str(args.repeats),
        "--timeout",
        str(args.timeout),
    ]
    if args.peer_ucx_tls:
        cmd += ["--ucx-tls", args.peer_ucx_tls]
    try:
        report_child(report, cmd, min(args.peer_timeout_s, left), NAME, "child finished")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- the child -------------------------------------------------------------------


def _row(what: str, status: str, detail: str) -> None:
    detail = " ".join(detail.split())  # one line
    print(f"ROW\t{what}\t{status}\t{detail}", flush=True)


def _check(what: str, ok: bool, detail: str) -> bool:
    _row(what, "PASS" if ok else "FAIL", detail)
    return ok


def _raw_read(agent, remote: str, local: tuple[int, int], addr: int, timeout_s: float) -> float:
    """One NIXL READ of ``local[1]`` bytes at the peer's ``addr``; its seconds."""
    t0 = time.perf_counter()
    handle = agent.call(
        "xfer",
        "initialize_xfer",
        "READ",
        agent.descs([local]),
        agent.descs([(addr, local[1])]),
        remote,
    )
    state = agent.call("transfer", "transfer", handle)
    while state == "PROC":
        if time.perf_counter() - t0 > timeout_s:
            # still running: its handle and memory are left to the process's exit
            raise _StillRunning(f"the raw READ did not finish within {timeout_s:g} s")
        state = agent.call("check", "check_xfer_state", handle)
    secs = time.perf_counter() - t0
    agent.call("release", "release_xfer_handle", handle)
    if state != "DONE":
        raise RuntimeError(f"the raw READ ended {state}")
    return secs


class _StillRunning(TimeoutError):
    """A READ still in flight: nothing it may write into is released."""


def child(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", required=True)
    p.add_argument("--pages", type=int, default=16)
    p.add_argument("--page-kib", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--ucx-tls", default=None)
    args = p.parse_args(argv)
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # read when each agent (and kvbm-pool's) starts
    sys.path.insert(0, str(REPO))
    import torch

    from vllm_kvbm.tiers.page_codec import PageCodec
    from vllm_kvbm.tiers.page_format import HEADER_BYTES
    from vllm_kvbm.tiers.peer.agent import PeerAgent
    from vllm_kvbm.tiers.peer.control import ControlLink
    from vllm_kvbm.tiers.peer.store import PeerStore
    from vllm_kvbm.tiers.pool.layout import SUPERBLOCK_BYTES
    from vllm_kvbm.tiers.pool.pool_file import PoolSpec
    from vllm_kvbm.tiers.pool.store import PoolStore
    from vllm_kvbm.tools.server import free_port
    from vllm_kvbm.worker.host_pool import HostPool

    cuda = args.device == "cuda"
    # an index: HostPool's registering threads set it as their device
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n, page_bytes = args.pages, args.page_kib << 10
    codec = PageCodec(NS, page_bytes, None, layout="L")
    stride = -(-(HEADER_BYTES + page_bytes) // 4096) * 4096
    # room for every page whatever set of the table it falls in: 4x the pages
    spec = PoolSpec.for_worker(
        args.dir, NS, page_bytes, 0, 1, "L", SUPERBLOCK_BYTES + 4096 + 4 * n * stride
    )
    writer = PoolStore.open(spec, codec)
    keys = [i.to_bytes(4, "little") * 8 for i in range(1, n + 1)]
    served = torch.randint(
        0, 256, (n, page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    stored = sum(writer.put(k, served[i]) for i, k in enumerate(keys))
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    # In this process group (the parent's kill ends it too); its log into
    # this process's stderr, the parent's log of the case (fd 2).
    sock = os.path.join(args.dir, "pool.sock")
    pool = start_pool(args.dir, sock, port, stdin=subprocess.DEVNULL, stdout=2)
    link = agent = reader = dst = raw = None
    regs = []
    running = False  # a READ still in flight: its memory is kept to the process's exit
    try:
        _check("pages written into the pool file", stored == n, f"{stored}/{n} stored")
        link = ControlLink(endpoint)
        reply, metadata = pool_hello(link, spec, pool, min(args.timeout, 60.0))
        _row(
            "pool",
            "info",
            f"{n} pages of {page_bytes >> 10} KiB in {spec.path} served by "
            f"kvbm-pool (pid {pool.pid}) at {endpoint}; UCX_TLS="
            f"{os.environ.get('UCX_TLS', '(default)')}",
        )
        # the pages' destination and the raw READ's, pinned as the host tier is
        dst = HostPool(n, page_bytes, pin=cuda, device=device)
        span = min(n * stride, int(reply["length"]) - int(reply["data_off"]))
        raw = HostPool(1, span, pin=cuda, device=device)
        if cuda:
            if not _check(
                "host memory pinned (cudaHostRegister)",
                dst.pinned and raw.pinned and dst.tensor.is_pinned(),
                f"HostPool pinned: {dst.pinned}, {raw.pinned}; is_pinned="
                f"{dst.tensor.is_pinned()}; {dst.pages}",
            ):
                return 0  # said in its row (HostPool's warning, in the log, says why)
        else:
            _row("host memory", "info", "pageable: no CUDA device (CPU run), pinning skipped")

        reader = PeerStore(
            codec, 0, 1, spec.scope_digest, spec.name, read_timeout_s=min(args.timeout, 30.0)
        )
        if hasattr(reader, "reads_into"):  # as the host tier's slots are: READ in place
            reader.reads_into(dst.tensor)
            how = "READ in place into the host memory (registered with reads_into)"
        else:
            how = "through the reader's landing slots, then copied into the host memory"
        _row("reader path", "info", how)
        agent = PeerAgent("kvbm-gpu-check-raw")
        remote = agent.call("add", "add_remote_agent", metadata)
        wait = time.monotonic() + 30
        while not agent.call("check", "check_remote_metadata", remote):
            if time.monotonic() > wait:
                raise TimeoutError("the pool's NIXL metadata did not load")
            time.sleep(0.01)
        local = (raw.tensor.data_ptr(), span)
        regs.append(agent.register(*local))
        remote_addr = int(reply["base"]) + int(reply["data_off"])
        items = [(k, dst.tensor[i]) for i, k in enumerate(keys)]
        raw_s, peer_s, bad = [], [], []
        for _ in range(args.repeats + 1):  # the first sets up the connections: not timed
            try:
                raw_s.append(_raw_read(agent, remote, local, remote_addr, args.timeout))
            except _StillRunning:
                running = True
                raise
            dst.tensor.zero_()
            t0 = time.perf_counter()
            statuses = reader.get_many_into(items, endpoint=endpoint)
            peer_s.append(time.perf_counter() - t0)
            running = running or "late" in statuses  # may still write into dst
            equal = sum(
                s == "ok" and torch.equal(dst.tensor[i], served[i]) for i, s in enumerate(statuses)
            )
            bad.append((n - equal, [s for s in statuses if s != "ok"][:3]))
        worst = max(bad)
        into = "pinned host memory" if cuda else "pageable host memory (CPU run)"
        if not _check(
            "peer read, bytes equal the served pages",
            worst[0] == 0,
            f"{n - worst[0]}/{n} pages 'ok' and byte-equal in the worst of "
            f"{len(bad)} rounds, read into {into}" + (f"; statuses {worst[1]}" if worst[1] else ""),
        ):
            return 0  # said in its row
        med = statistics.median
        peer_gbps, raw_gbps = n * page_bytes / med(peer_s[1:]), span / med(raw_s[1:])
        _row(
            "peer read GB/s (vs raw NIXL READ)",
            "info",
            f"{peer_gbps / 1e9:.2f} / {raw_gbps / 1e9:.2f} (peer/raw {peer_gbps / raw_gbps:.2f}; "
            f"{n * page_bytes >> 20} MiB of pages, raw {span >> 20} MiB in one READ; medians of "
            f"{args.repeats} rounds, perf_counter from the post until done; UCX_TLS="
            f"{os.environ.get('UCX_TLS', '(default)')})",
        )
        if not cuda:
            _row("GPU copy", "info", "skipped: no CUDA device (CPU run)")
            return 0
        gpu = torch.empty((n, page_bytes), dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(args.repeats):
            gpu.zero_()
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            gpu.copy_(dst.tensor, non_blocking=True)  # from the pinned pages
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        same = torch.equal(gpu, served.to(device))
        _check(
            "GPU copy, bytes equal the served pages",
            same,
            f"{n} pages, {n * page_bytes / best / 1e9:.1f} GB/s h2d from the pinned pages "
            f"(CUDA events, best of {args.repeats})",
        )
        return 0
    finally:
        if reader is not None:
            reader.close()
        if link is not None:
            link.close()
        if running:  # kept, registered, to the process's exit
            _KEPT.extend([dst, raw, agent])
            regs, dst, raw = [], None, None
        pool.terminate()
        try:
            pool.wait(30)
        except subprocess.TimeoutExpired:
            pool.kill()
            pool.wait(30)
        writer.close()
        for reg in regs:
            agent.deregister(reg)
        for host in (dst, raw):
            if host is not None:
                host.release()


def main(argv: list[str]) -> int:
    """The child; an exception is a failed row (its traceback in the log)."""
    try:
        return child(argv)
    except Exception as err:
        _check("ran", False, f"{type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
