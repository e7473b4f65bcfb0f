"""A serving peer in a process of its own: holds a pool file (created or found
again in --dir) and serves it with a real PeerServer (NIXL agent, ZMQ control
endpoint) on 127.0.0.1:--port, the way a worker or kvbm-pool does. Prints
``ready <incarnation>`` once serving, then serves until killed or its stdin
closes. The tests write pages into the same file from their own process (the
file is shared memory), and stop, kill and restart this one.

    python tests/helpers/pool_peer.py --dir D --port P --page-bytes N --pages K
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--page-bytes", type=int, required=True)
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--namespace", default="ns-peer")
    p.add_argument("--layout", default="L")
    args = p.parse_args()
    from vllm_kvbm.tiers.peer.server import PeerServer
    from vllm_kvbm.tiers.pool.pool_file import open_pool

    pool = open_pool(pool_spec(args.dir, args.page_bytes, args.pages, args.namespace, args.layout))
    server = PeerServer("127.0.0.1", args.port)
    server.serve(pool)
    print(f"ready {server.incarnation}", flush=True)
    try:
        sys.stdin.read()  # until the test closes it (or kills this process)
    finally:
        server.close()
        pool.close()


def pool_spec(
    directory: str,
    page_bytes: int,
    pages: int,
    namespace: str = "ns-peer",
    layout_fp: str = "L",
    rank: int = 0,
    world: int = 1,
):
    from vllm_kvbm.tiers.page_format import HEADER_BYTES
    from vllm_kvbm.tiers.pool.layout import SUPERBLOCK_BYTES
    from vllm_kvbm.tiers.pool.pool_file import PoolSpec

    stride = -(-(HEADER_BYTES + page_bytes) // 4096) * 4096
    return PoolSpec.for_worker(
        directory,
        namespace,
        page_bytes,
        rank,
        world,
        layout_fp,
        SUPERBLOCK_BYTES + 4096 + pages * stride,
    )


def start(
    directory: str,
    port: int,
    page_bytes: int,
    pages: int,
    env: dict | None = None,
    timeout: float = 60.0,
    namespace: str = "ns-peer",
) -> tuple[subprocess.Popen, str]:
    """The peer process, once it serves, and its incarnation."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "pool_peer.py"),
            "--dir",
            directory,
            "--port",
            str(port),
            "--page-bytes",
            str(page_bytes),
            "--pages",
            str(pages),
            "--namespace",
            namespace,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1]), **(env or {})},
    )
    from helpers.pool_engine import wait_line

    return proc, wait_line(proc, "ready ", timeout)


if __name__ == "__main__":
    main()
