"""Peer read bandwidth against NIXL's raw READ on the same transport.

A pool file of PAGES pages (4 MiB each by default, a 128-token page of the
demo's model in float32) is written in a temporary directory under /dev/shm
and served by a real ``kvbm-pool`` process (its NIXL agent, its control
endpoint). This process then reads the same bytes twice, alternately, for
--repeats rounds:

- raw: one NIXL READ of the pool's data region (every slot the pages are in,
  back to back) into a registered buffer, after the same ``hello``: what the
  transport moves with nothing on top;
- peer: ``PeerStore.get_many_into`` of the pages' keys into the rows of a
  host tier registered with the reader (``reads_into``), as an engine's
  worker reads a peer's pages: each batch's set entries and entries again
  into landing slots, each page's payload straight into its row, then each
  page checked there (key, scope, CRC, or the seal under --secret).
  ``--landing-copy``: rows not registered, so pages land whole in landing
  slots and are copied out (the reader before in-place reads);
  ``--serial-checks``: every page checked on the reading thread (no overlap
  of a batch's checks with the next batch's READs).

Both are timed from the first post to the last byte; the ratio peer/raw of
the medians is printed, for UCX's default transport (on one machine:
``cma``) and for UCX over TCP (``UCX_TLS=tcp``, as between machines), each in
a process of its own (UCX reads its transports when an agent is made).

    python benchmarks/bench_peer_read.py [--pages 64] [--page-mib 4] [--repeats 5]
                                         [--transport default tcp] [--secret]
                                         [--landing-copy] [--serial-checks]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pool_process import pool_hello, start_pool

NS = "bench-peer"


def child(args) -> dict:
    """One transport's measurement (this process's UCX_TLS is already set)."""
    import mmap

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

    page_bytes, pages = args.page_mib << 20, args.pages
    secret = b"s" * 32 if args.secret else None
    codec = PageCodec(NS, page_bytes, secret, layout="L")
    stride = -(-(HEADER_BYTES + page_bytes) // 4096) * 4096
    # room for every page whatever set it falls in: 4x the pages
    spec = PoolSpec.for_worker(
        args.dir, NS, page_bytes, 0, 1, "L", SUPERBLOCK_BYTES + 4096 + 4 * pages * stride
    )
    writer = PoolStore.open(spec, codec)
    keys = [i.to_bytes(4, "little") * 8 for i in range(1, pages + 1)]
    gen = torch.Generator().manual_seed(1)
    for k in keys:
        assert writer.put(k, torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen))
    port = free_port()
    sock = os.path.join(args.dir, "pool.sock")
    pool = start_pool(
        args.dir, sock, port, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    endpoint = f"tcp://127.0.0.1:{port}"
    reader = PeerStore(
        codec, 0, 1, spec.scope_digest, spec.name, read_timeout_s=30.0, landing_pages=args.landing
    )
    host = torch.empty(pages, page_bytes, dtype=torch.uint8)  # the host tier's slots
    host.fill_(0)  # faulted in, as the engine's host tier is at startup
    if not args.landing_copy:
        reader.reads_into(host)
    reader.check_ahead = not args.serial_checks
    outs = list(host)
    link = ControlLink(endpoint)
    agent = PeerAgent("bench-raw-reader")
    try:
        try:  # kvbm-pool takes up the file it finds at start
            reply, metadata = pool_hello(link, spec, pool, 60.0)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{err}: {pool.stderr.read()}") from None
        # raw: the data region's slots, as one READ
        first, span = int(reply["data_off"]), pages * 4 * stride
        span = min(span, int(reply["length"]) - first)
        buf = mmap.mmap(-1, span)
        cbuf = ctypes.c_char.from_buffer(buf)
        addr = ctypes.addressof(cbuf)
        remote = agent.call("add", "add_remote_agent", metadata)
        while not agent.call("check", "check_remote_metadata", remote):
            time.sleep(0.01)
        reg = agent.register(addr, span)
        raw, peer = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            handle = agent.call(
                "xfer",
                "initialize_xfer",
                "READ",
                agent.descs([(addr, span)]),
                agent.descs([(int(reply["base"]) + first, span)]),
                remote,
            )
            state = agent.call("transfer", "transfer", handle)
            while state == "PROC":
                state = agent.call("check", "check_xfer_state", handle)
            raw.append((time.perf_counter() - t0, span))
            agent.call("release", "release_xfer_handle", handle)
            assert state == "DONE", state
            t0 = time.perf_counter()
            statuses = reader.get_many_into(list(zip(keys, outs)), endpoint=endpoint)
            peer.append((time.perf_counter() - t0, pages * page_bytes))
            assert statuses == ["ok"] * pages, statuses
        agent.deregister(reg)
        del cbuf
        buf.close()
        gbps = [b / t / 1e9 for t, b in raw], [b / t / 1e9 for t, b in peer]
        return {
            "raw_gbps": gbps[0],
            "peer_gbps": gbps[1],
            "ratio": statistics.median(gbps[1]) / statistics.median(gbps[0]),
        }
    finally:
        reader.close()
        link.close()
        pool.terminate()
        pool.wait(30)
        writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-mib", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--landing",
        type=int,
        default=None,
        help="the reader's landing slots (default: an engine's, about 64 MiB of pages, 4-16)",
    )
    p.add_argument("--transport", nargs="+", default=["default", "tcp"], choices=["default", "tcp"])
    p.add_argument("--secret", action="store_true", help="pages sealed under a page secret")
    p.add_argument(
        "--landing-copy",
        action="store_true",
        help="read through landing slots and copy out (host rows not registered)",
    )
    p.add_argument(
        "--serial-checks",
        action="store_true",
        help="check every page on the reading thread (no overlap)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    print(
        f"{args.pages} pages of {args.page_mib} MiB, {args.repeats} rounds, "
        f"{'sealed' if args.secret else 'CRC only'}, landing slots {args.landing or 'as an engine'}"
        f"{', copied out of them' if args.landing_copy else ', pages read in place'}"
        f"{', checks on the reading thread' if args.serial_checks else ''}",
        flush=True,
    )
    for transport in args.transport:
        directory = tempfile.mkdtemp(prefix="kvbm-bench-peer-", dir="/dev/shm")
        env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
        if transport == "tcp":
            env["UCX_TLS"] = "tcp"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--dir",
            directory,
            "--pages",
            str(args.pages),
            "--page-mib",
            str(args.page_mib),
            "--repeats",
            str(args.repeats),
        ]
        cmd += ["--landing", str(args.landing)] if args.landing else []
        if args.secret:
            cmd.append("--secret")
        cmd += ["--landing-copy"] * args.landing_copy + ["--serial-checks"] * args.serial_checks
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            if out.returncode or not line.startswith("{"):
                print(f"{transport}: failed ({out.returncode}): {out.stderr[-2000:]}")
                continue
            r = json.loads(line)
            med = statistics.median
            print(
                f"{transport:8s} raw NIXL READ {med(r['raw_gbps']):6.2f} GB/s   "
                f"peer reads {med(r['peer_gbps']):6.2f} GB/s   peer/raw {r['ratio']:.2f}   "
                f"(raw {', '.join(f'{x:.2f}' for x in r['raw_gbps'])}; "
                f"peer {', '.join(f'{x:.2f}' for x in r['peer_gbps'])})",
                flush=True,
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
